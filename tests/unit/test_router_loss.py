"""The router's load-balancing loss as sums that cross pipeline stages (model/router_aux.py).

- The sums, added layer by layer and cut anywhere, give transformers' own `load_balancing_loss_func`
  (with and without a padding mask).
- On the wire in a 16-bit message dtype they travel as the fp32 bits, both ways (the gradient too).
- Across transformers' zoo, every mixture of experts whose config names a router_aux_loss_coef,
  with output_router_logits on, is exact on a small instance cut into stages (the anatomy's check,
  which compares the stages' sums against the architecture's own aux_loss) or refused by name.
"""

from __future__ import annotations

import pytest
import torch

from mesh3d.model.router_aux import RouterAux, from_wire, to_wire

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("masked", [False, True])
def test_sums_over_any_cut_of_the_layers_give_transformers_loss(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    experts, top_k, rows, layers = 6, 2, 12, 5
    logits = tuple(torch.randn(rows, experts, requires_grad=True) for _ in range(layers))
    mask = (torch.rand(3, 4) > 0.3).long() if masked else None
    want = load_balancing_loss_func(logits, experts, top_k, mask)
    aux = RouterAux(0.01, experts, top_k)
    for cut in (0, 2, 5):  # the sums handed from a first "stage" of `cut` layers to a second
        sums = aux.start(torch.device("cpu"))
        for layer in logits[:cut]:
            sums = aux.add_layer(sums, layer, mask)
        sums = from_wire(to_wire(sums, torch.bfloat16))
        for layer in logits[cut:]:
            sums = aux.add_layer(sums, layer, mask)
        got = aux.loss(sums)
        assert torch.equal(got, want)
        grads = torch.autograd.grad(got, logits)
        want_grads = torch.autograd.grad(want, logits, retain_graph=True)
        assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-9) for g, w in zip(grads, want_grads))


def test_sums_travel_as_bits_in_a_16_bit_message():
    sums = torch.tensor([3.0, 1.0e-7, 123456.789, 0.1], requires_grad=True)
    wire = to_wire(sums, torch.bfloat16)
    assert wire.dtype == torch.bfloat16 and wire.numel() == 2 * sums.numel()
    received = wire.detach().requires_grad_(True)  # as the next stage takes a message
    assert torch.equal(from_wire(received), sums.detach())  # no rounding
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0e-3])
    (from_wire(received) * weights).sum().backward()
    assert received.grad.dtype == torch.bfloat16  # the gradient message: bits too
    torch.autograd.backward(wire, received.grad)  # the sender's backward from what came back
    assert torch.equal(sums.grad, weights)
    assert to_wire(sums, torch.float32).dtype == torch.float32  # a 32-bit message holds the values themselves


def test_the_zoo_with_its_router_loss_on_is_exact_or_refused_by_name():
    import zoo_cases

    from mesh3d.model.intake import anatomy_of

    exact, refused, dense = [], {}, []
    for model_type in zoo_cases.population():
        config = zoo_cases.tiny_config(model_type)  # the router loss on where the config names a coefficient
        if not getattr(config, "output_router_logits", False):
            continue
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        try:
            anatomy = anatomy_of(model)
        except ValueError as error:
            refused[model_type] = (type(model).__name__, str(error))
            continue
        if anatomy.router_aux is None:  # no block routes in this configuration (doge's default is dense)
            dense.append(model_type)
            continue
        want = RouterAux(config.router_aux_loss_coef, model.num_experts, model.num_experts_per_tok)
        assert anatomy.router_aux == want
        exact.append(model_type)
    assert {"qwen3_moe", "mixtral", "qwen2_moe"} <= set(exact)
    for model_type, (name, message) in refused.items():  # by name
        assert message.startswith(f"{name} ({model_type}): "), message
    assert len(exact) >= 14 and len(dense) <= 1, (exact, refused, dense)


def test_the_planner_measures_a_model_with_its_router_loss_on():
    # its stages hand the sums on beside the activation; the probe measures the activation alone
    import hf_cases

    import mesh3d

    model = hf_cases.meta_hf_model("qwen3_moe", output_router_logits=True)
    sizes = dict(gpus=2, gpus_per_node=2, hardware="h100", seq_len=hf_cases.SEQ_LEN, global_batch=4)
    plans = mesh3d.plan(model, fix={"pp": 2, "tp": 1, "schedule": "1f1b", "activation_checkpoint": "never"}, **sizes)
    assert plans and all(p.pp == 2 and p.memory_per_rank.activations > 0 for p in plans)
