"""The split backward (I, then W) gives a whole backward's gradients, and walks each part of the
graph once: W never runs the nodes of the input-gradient chain that no weight hangs from."""

import torch
import torch._functorch.config
from pipeline_cases import tiny_args
from torch import nn

from examples.llama.model import Transformer
from mesh3d.pipeline.backward_halves import backward_input, backward_weight

TOLERANCE = 1e-6  # fp32: the same operations, only run in two passes


def _middle_stage() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(tiny_args(False, n_layers=2))
    model.init_weights()
    model.tok_embeddings = model.norm = model.output = None  # a stage between two others
    return model


def _whole_and_split(module: nn.Module, x: torch.Tensor, output_grad=None, loss=None):
    def run(split: bool):
        module.zero_grad(set_to_none=True)
        stage_input = x.detach().requires_grad_(True)
        out = module(stage_input)
        if loss is not None:
            out = loss(out)
        if not split:
            torch.autograd.backward(out, output_grad)
            return stage_input.grad, {n: p.grad.clone() for n, p in module.named_parameters()}
        input_grad, pending = backward_input(out, output_grad, stage_input)
        assert all(p.grad is None for p in module.parameters()), "I must not touch weight gradients"
        backward_weight(pending)
        return input_grad, {n: p.grad.clone() for n, p in module.named_parameters()}

    return run(False), run(True)


def _assert_close(whole, split):
    (input_whole, weights_whole), (input_split, weights_split) = whole, split
    torch.testing.assert_close(input_split, input_whole, rtol=TOLERANCE, atol=0)
    assert weights_split.keys() == weights_whole.keys()
    for name in weights_whole:
        torch.testing.assert_close(weights_split[name], weights_whole[name], rtol=TOLERANCE, atol=1e-9, msg=name)


def test_split_equals_whole_backward_for_a_transformer_stage():
    stage = _middle_stage()
    x = torch.randn(2, 8, stage.layers["0"].attention.wq.weight.shape[1])
    _assert_close(*_whole_and_split(stage, x, output_grad=torch.randn_like(x)))


def test_split_equals_whole_backward_for_a_last_stage_loss():
    torch.manual_seed(0)
    model = Transformer(tiny_args(True, n_layers=2))
    model.init_weights()
    model.tok_embeddings = None  # the last stage: blocks, norm, (tied) head
    x = torch.randn(2, 8, model.norm.weight.shape[0])
    targets = torch.randint(0, model.output.weight.shape[0], (2, 8))
    loss = lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
    _assert_close(*_whole_and_split(model, x, loss=loss))


class _SharedWeight(nn.Module):
    """One weight used at two depths (its branches leave the chain at two places, one upstream of
    the other), and a weight that does not depend on the input at all."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Parameter(torch.randn(8, 8) / 8)
        self.other = nn.Parameter(torch.randn(8, 8) / 8)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.tanh(x @ self.shared)
        h = torch.tanh(h @ self.other) @ self.shared
        return h + self.bias


def test_a_weight_used_twice_is_counted_once_per_use():
    module = _SharedWeight()
    x = torch.randn(4, 8)
    _assert_close(*_whole_and_split(module, x, output_grad=torch.randn(4, 8)))


def test_an_output_that_does_not_depend_on_the_input_leaves_a_whole_backward():
    weight = nn.Parameter(torch.randn(3))
    stage_input = torch.randn(3, requires_grad=True)
    out = weight * 2.0  # the stage input is not used
    input_grad, pending = backward_input(out, torch.ones(3), stage_input)
    assert pending is None and torch.equal(input_grad, torch.zeros(3))


def test_w_does_not_walk_the_input_gradient_chain_again():
    stage = _middle_stage()
    x = torch.randn(2, 8, stage.layers["0"].attention.wq.weight.shape[1]).requires_grad_(True)
    out = stage(x)
    attention_nodes = []
    queue, seen = [out.grad_fn], set()
    while queue:  # every attention backward in the graph: chain nodes no weight hangs from
        node = queue.pop()
        if node in seen or node is None:
            continue
        seen.add(node)
        if "Attention" in node.name():
            attention_nodes.append(node)
        queue.extend(child for child, _ in node.next_functions)
    assert len(attention_nodes) == 2  # one per block
    runs = []
    for node in attention_nodes:
        node.register_prehook(lambda grads: runs.append("attention"))
    _, pending = backward_input(out, torch.randn_like(out), x)
    assert len(runs) == 2  # I runs each once
    backward_weight(pending)
    assert len(runs) == 2, "W ran an attention backward again"


@torch._functorch.config.patch(donated_buffer=False)  # as compile_blocks sets it for split schedules
def test_a_compiled_block_is_backpropagated_once():
    """A compiled block's backward is one node computing input and weight gradients together: I
    keeps the weight gradients it computed, and W does not run the node again."""
    stage = _middle_stage()
    for block in stage.layers.values():
        block.forward = torch.compile(block.forward, backend="aot_eager")
    x = torch.randn(2, 8, stage.layers["0"].attention.wq.weight.shape[1])
    output_grad = torch.randn_like(x)
    _assert_close(*_whole_and_split(stage, x, output_grad=output_grad))
    stage.zero_grad(set_to_none=True)
    stage_input = x.detach().requires_grad_(True)
    out = stage(stage_input)
    _, pending = backward_input(out, output_grad, stage_input)
    compiled = [group for group in pending.groups if group.chain_nodes[0].name() == "CompiledFunctionBackward"]
    assert len(compiled) == 2 and all(group.computed is not None for group in compiled)
    runs = []
    for group in compiled:
        group.chain_nodes[0].register_prehook(lambda grads: runs.append(1))
    backward_weight(pending)
    assert not runs, "W ran a compiled block's backward again"
