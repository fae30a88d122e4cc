"""Context parallelism (cp): each sequence cut over cp ranks, attention over the whole sequence,
against one process running the same model on the same whole batch (fp32, 1e-5: losses, clipped
grad norms, every parameter after 2 AdamW steps).

`mesh3d.build_mesh(pp=..., dp=..., cp=..., tp=...)` called exactly so. Cases (the example LLaMA,
plain and with packed documents, and a protocol model of its own attention):
- cp = 2 alone (and with the head fused with the loss), and cp = 4 (one token per chunk at seq 8:
  every rank's head and tail), alone and with pp (ZBV, DDP, tied);
- cp composed with pp (1f1b, zbv: split backward; interleaved), dp (FSDP and DDP), tp with
  sequence parallel and loss parallel, tied weights, activation checkpointing;
- against cp = 1 on the same ranks: PipeDream-2BW, torch.compile with selective checkpointing, bf16;
- a checkpoint saved at cp = 2 resumed at cp = 4 and cp = 1;
- bad input refused on every rank: a sequence length that does not cut into 2 x cp chunks, a
  model without position_ids, a block that attends by hand, a mean loss.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, SEQ_LEN, STEPS, TOLERANCE, VOCAB, meta_model, tiny_args, tp_args, worst_error
from rank_errors import assert_raised_on_every_rank, messages_of
from torch import nn

import mesh3d
from examples.llama.model import Transformer, llama_tp_plan, loss_fn
from mesh3d.data.documents import document_ids

EOS = 0
GLOBAL_BATCH = 4


def data_of(seed: int, documents: bool) -> list[tuple]:
    """(inputs, targets, document ids or None) per step: random tokens, separators in about one place of four."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(STEPS):
        stream = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
        if documents:
            stream[torch.rand(stream.shape, generator=generator) < 0.25] = EOS
        inputs, targets = stream[:, :-1], stream[:, 1:]
        data.append((inputs, targets, document_ids(inputs, EOS) if documents else None))
    return data


def reference(args, data):
    """One process, whole model, whole batch."""
    model = Transformer(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets, documents in data:
        extra = {} if documents is None else {"document_ids": documents}
        loss = loss_fn(model(inputs, **extra), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inputs, targets, documents = data[0]
    with torch.no_grad():
        evaluated = loss_fn(model(inputs, **({} if documents is None else {"document_ids": documents})), targets)
    return losses, norms, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, evaluated.item()


def _cp_run(sizes, args, data, options):
    pp, dp, cp, tp = sizes
    layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp)
    assert layout.mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert layout.coordinate == (layout.pp_rank, layout.dp_rank, layout.cp_rank, layout.tp_rank)
    assert layout.rank == ((layout.pp_rank * dp + layout.dp_rank) * cp + layout.cp_rank) * tp + layout.tp_rank
    if options.get("loss_parallel"):
        options = {"schedule": "1f1b", "tp_plan": llama_tp_plan(loss_parallel=True), **options}
    pm = mesh3d.parallelize(meta_model(False, args=args), layout, **options)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, norms = [], []
    share = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
    for inputs, targets, documents in data:
        extra = {} if documents is None else {"document_ids": documents[share]}
        losses.append(pm.step(inputs[share], targets[share], **extra).item())
        norms.append(pm.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    inputs, targets, documents = data[0]
    extra = {} if documents is None else {"document_ids": documents[share]}
    evaluated = pm.evaluate(inputs[share], targets[share], **extra).item()
    # Pipeline messages carry the chunk: 1/cp of each sequence (and 1/tp of that under sequence parallel).
    sent = pm.comm_bytes().get((0, 1)) if layout.pp_rank == 0 and pp > 1 else None
    expected = GLOBAL_BATCH // dp * SEQ_LEN // cp // tp * args.dim * 4
    assert sent in (None, expected), (sent, expected)
    return (losses, norms, pm.full_state_dict(), None), evaluated


def _cases(cases):
    return [_cp_run(*case) for case in cases]


def _check(cases, world):
    """Every case in one launch of `world` ranks, each against its one-process reference."""
    per_rank = run_on_ranks(_cases, world, cases, timeout=450)
    for index, (sizes, args, data, options) in enumerate(cases):
        *ref, ref_evaluated = reference(args, data)
        for results in per_rank:
            trained, evaluated = results[index]
            error, where = worst_error(trained, ref)
            assert error <= TOLERANCE, f"{sizes} {options}: relative error {error:.2e} at {where}"
            assert abs(evaluated - ref_evaluated) <= TOLERANCE * abs(ref_evaluated), (sizes, evaluated, ref_evaluated)
            assert trained[0] == per_rank[0][index][0][0]  # the same losses on every rank


def test_cp2_alone_and_with_documents():
    plain, documents = data_of(0, False), data_of(1, True)
    cases = [
        ((1, 1, 2, 1), tiny_args(False, 2), plain, {"schedule": "1f1b"}),
        ((1, 1, 2, 1), tiny_args(False, 2), documents, {"schedule": "1f1b"}),
        # the head fused with the loss: each cp rank's chunk of rows against its own targets
        ((1, 1, 2, 1), tiny_args(True, 2), documents, {"schedule": "1f1b", "fused_loss": True}),
    ]
    _check(cases, 2)


def test_cp4_and_cp_with_pp_dp_tp_on_four_ranks():
    plain, documents = data_of(2, False), data_of(3, True)
    cases = [
        ((1, 1, 4, 1), tiny_args(False, 2), documents, {"schedule": "1f1b"}),
        ((2, 1, 2, 1), tiny_args(True, 4), plain, {"schedule": "zbv", "microbatches": 2}),
        ((1, 2, 2, 1), tiny_args(False, 2), documents, {"schedule": "1f1b", "dp_mode": "ddp"}),
        ((1, 1, 2, 2), tp_args(False, 2), documents, {"activation_checkpoint": "always", "loss_parallel": True}),
    ]
    _check(cases, 4)


def test_cp_in_eight_ranks():
    documents = data_of(4, True)
    cases = [
        ((2, 1, 2, 2), tp_args(True, 4), documents, {"schedule": "interleaved_1f1b", "microbatches": 2}),
        ((2, 2, 2, 1), tiny_args(False, 4), documents, {"schedule": "1f1b", "microbatches": 2}),
        ((2, 1, 4, 1), tiny_args(True, 4), documents, {"schedule": "zbv", "microbatches": 2, "dp_mode": "ddp"}),
    ]
    _check(cases, 8)


class LearnedPositionsLM(nn.Module):
    """A protocol model of its own (GPT-2-like): learned position embeddings read from
    `position_ids` (so a chunk that took its positions from itself would train another model), and
    attention through F.scaled_dot_product_attention(is_causal=True), or as `attention` says (Block)."""

    def __init__(self, attention: str = "causal", positions: bool = True, dim: int = 16, layers: int = 2):
        super().__init__()
        self.vocab_size = VOCAB
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.pos_embeddings = nn.Embedding(SEQ_LEN, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, attention) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        if not positions:
            self.forward = self.forward_without_positions

    def forward(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(position_ids)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def forward_without_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return LearnedPositionsLM.forward(self, tokens)


class Block(nn.Module):
    """`attention`: "causal" (is_causal=True), "by hand" (no SDPA call), "causal mask" (an explicit
    causal mask on its own tokens), "odd ranks unmasked" (cp rank 0 is_causal=True, the others an
    all-True mask: calls of different kinds), "rank 1 unmasked" (so in one cp group of two only),
    "random mask" (a mask no whole sequence extends)."""

    def __init__(self, dim: int, attention: str):
        super().__init__()
        self.attention = attention
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has a zero gradient: Adam would magnify its noise
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=x.device).tril()
        if self.attention == "by hand":
            scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        elif self.attention == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attention == "causal mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        elif self.attention == "random mask":
            every_other_key = torch.arange(k.shape[-2], device=x.device) % 2 == 0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & every_other_key)
        else:  # "odd ranks unmasked", "rank 1 unmasked"
            # tp = 1: consecutive ranks are a cp group's
            masked = dist.get_rank() == 1 if self.attention == "rank 1 unmasked" else dist.get_rank() % 2 == 1
            mask = torch.ones_like(causal) if masked else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
        h = x + self.proj(out.transpose(1, 2).flatten(2))
        return h + self.mlp(h)


def _own_model_reference(data):
    torch.manual_seed(0)
    model = LearnedPositionsLM()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets, _ in data:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    final = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return {k: v.numpy().copy() for k, v in state.items()}, losses, final


def _own_model_and_errors(initial, data):
    layout = mesh3d.build_mesh(pp=2, dp=1, cp=2, tp=1)
    model = LearnedPositionsLM()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    pm = mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=2)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for inputs, targets, _ in data:
        losses.append(pm.step(inputs, targets).item())
        optimizer.step()
        optimizer.zero_grad()
    inputs, targets, _ = data[0]
    mean = mesh3d.parallelize(meta_model(False, args=tiny_args(False, 2)), layout, schedule="1f1b", loss_fn=loss_fn)

    def step_with(attention: str, on=layout, schedule: str = "1f1b", call: str = "step"):
        model = LearnedPositionsLM(attention)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
        # a never-draining schedule updates inside the pipeline: it owns the optimizer
        owned = {"optimizer": functools.partial(torch.optim.AdamW, lr=LR)} if schedule.startswith("pipedream") else {}
        pm = mesh3d.parallelize(model, on, schedule=schedule, microbatches=2, **owned)
        loss = getattr(pm, call)(inputs, targets)
        pm.flush()  # the call's verdicts are judged one call late: here, by the flush that ends a run
        return loss

    two_cp_groups = mesh3d.build_mesh(pp=1, dp=2, cp=2, tp=1)

    # a causal mask on one's own tokens is the causal call: the first step's loss, as is_causal gives it
    causal_mask_loss = step_with("causal mask").item()
    errors = messages_of(
        {
            "length": lambda: pm.step(inputs[:, :6], targets[:, :6]),
            "mean loss": lambda: mean.step(inputs, targets),
            "no positions": lambda: mesh3d.parallelize(LearnedPositionsLM(positions=False), layout, schedule="1f1b"),
            "by hand": lambda: mesh3d.parallelize(LearnedPositionsLM("by hand"), layout, schedule="1f1b"),
            # refused together by the next call, never a rank left waiting in its next gather
            "calls of different kinds": lambda: step_with("odd ranks unmasked"),
            "a mask no sequence extends": lambda: step_with("random mask"),
            "in evaluate": lambda: step_with("odd ranks unmasked", call="evaluate"),
            "never draining": lambda: step_with("odd ranks unmasked", schedule="pipedream_2bw"),
            "one cp group of two": lambda: step_with("rank 1 unmasked", on=two_cp_groups),
            "sizes": lambda: mesh3d.build_mesh(pp=2, dp=1, cp=3, tp=1),
        }
    )
    return losses, pm.full_state_dict(), errors, causal_mask_loss


def test_own_protocol_model_takes_global_positions_and_bad_input_is_refused_everywhere():
    data = data_of(5, False)
    initial, ref_losses, ref_state = _own_model_reference(data)
    per_rank = run_on_ranks(_own_model_and_errors, 4, initial, data, timeout=450)
    for losses, state, _, causal_mask_loss in per_rank:
        error, where = worst_error((losses, [], state, None), (ref_losses, [], ref_state))
        assert error <= TOLERANCE, f"relative error {error:.2e} at {where}"
        assert causal_mask_loss == pytest.approx(ref_losses[0], rel=TOLERANCE)
    expected = {
        "length": "sequence length 6 does not cut into 2*cp=4 equal chunks",
        "mean loss": "context parallelism (cp=2) needs a loss_fn that returns (loss_sum, count)",
        "no positions": "LearnedPositionsLM: context parallelism (cp=2) needs a model that takes position_ids",
        "by hand": "LearnedPositionsLM: context parallelism (cp=2): block(s) ['layers.0', 'layers.1'] never call",
        "calls of different kinds": "the whole sequence (cp rank 0: causal; cp rank 1: no mask (or an all-True one))",
        "a mask no sequence extends": "(cp rank 0: a boolean mask that is none of them; cp rank 1: a boolean mask",
        "in evaluate": "(cp rank 0: causal; cp rank 1: no mask (or an all-True one))",
        "never draining": "(cp rank 0: causal; cp rank 1: no mask (or an all-True one))",
        "one cp group of two": "(cp rank 0: causal; cp rank 1: no mask (or an all-True one))",
        "sizes": "pp*dp*cp*tp=6 does not equal the world size (pp=2, dp=1, cp=3, tp=1, world size=4)",
    }
    assert_raised_on_every_rank([errors for _, _, errors, _ in per_rank], expected)


def _steps(sizes, data, path, save_after=None, load=False):
    pp, dp, cp, tp = sizes
    layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp)
    pm = mesh3d.parallelize(meta_model(True, args=tiny_args(True, 4)), layout, schedule="1f1b", microbatches=2)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    share = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
    first = 0
    if load:
        first = mesh3d.checkpoint.load(path, pm, optimizer)["step"]
    losses = []
    for step in range(first, len(data)):
        inputs, targets, documents = data[step]
        losses.append(pm.step(inputs[share], targets[share], document_ids=documents[share]).item())
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == save_after:
            mesh3d.checkpoint.save(path, pm, optimizer, step=step + 1)
    return losses


def _resume_across_cp(data, path):
    uninterrupted = _steps((2, 1, 2, 1), data, path, save_after=1)
    return uninterrupted, _steps((1, 1, 4, 1), data, path, load=True), _steps((2, 2, 1, 1), data, path, load=True)


def test_checkpoint_saved_at_cp2_resumes_at_cp4_and_cp1(tmp_path):
    data = data_of(6, True) + data_of(7, True)[:1]  # three steps: one before the save, two after
    for uninterrupted, at_cp4, at_cp1 in run_on_ranks(_resume_across_cp, 4, data, str(tmp_path / "ckpt"), timeout=450):
        for resumed in (at_cp4, at_cp1):
            assert len(resumed) == 2
            for got, want in zip(resumed, uninterrupted[1:]):
                assert abs(got - want) <= TOLERANCE * abs(want), (resumed, uninterrupted)


def _twin_runs(cases):
    """Each case run twice on the same 4 ranks, at cp = 2 and at cp = 1 (dp = 2 in its place): the
    losses and the state after the steps, from each."""
    out = []
    for options, masked in cases:
        runs = []
        for sizes in ((2, 1, 2, 1), (2, 2, 1, 1)):
            pp, dp, cp, tp = sizes
            layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp)
            given = dict(options)
            if cp == 1:  # aot_eager computes with eager's kernels (test_compile.py): the twin runs eager
                given.pop("compile", None)
            factory = given.pop("optimizer_factory", None)
            model = meta_model(True, args=tiny_args(True, 4))
            pm = mesh3d.parallelize(model, layout, optimizer=factory, **given)
            optimizer = pm.optimizer or torch.optim.AdamW(pm.parameters(), lr=LR)
            share = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
            losses = []
            for inputs, targets, documents in masked:
                losses.append(pm.step(inputs[share], targets[share], document_ids=documents[share]).item())
                if pm.optimizer is None:
                    optimizer.step()
                    optimizer.zero_grad()
            runs.append((losses, pm.full_state_dict()))
        out.append(runs)
    return out


def test_cp_composes_with_never_drain_compile_selective_and_bf16():
    """Against the same training at cp = 1 (exact to one process or to its update rule elsewhere):
    PipeDream-2BW (updates inside the pipeline), torch.compile with selective checkpointing (on rows of
    one document: the causal path), bf16."""
    masked = []
    for inputs, targets, documents in data_of(8, True) * 2:  # four steps: never-drain rules need a few
        targets = targets.clone()
        targets[:, ::3] = -100  # microbatches and cp chunks count different numbers of targets
        masked.append((inputs, targets, documents))
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    # one document a row: causal calls, attended without mask rows (lower_right_causal.py), under
    # selective checkpointing's dispatch mode
    single = [(inputs, targets, torch.zeros_like(documents)) for inputs, targets, documents in masked]
    cases = [
        ({"schedule": "pipedream_2bw", "microbatches": 2, "optimizer_factory": adamw}, masked),
        ({"schedule": "1f1b", "microbatches": 2, "compile": "aot_eager", "activation_checkpoint": "selective"}, single),
        ({"schedule": "zbv", "microbatches": 2, "param_dtype": torch.bfloat16}, masked[:2]),
    ]
    tolerances = [TOLERANCE, TOLERANCE, 2e-2]  # bf16: the cut changes rounding, not the model
    for (at_cp2, at_cp1), (options, _), tolerance in zip(
        run_on_ranks(_twin_runs, 4, cases, timeout=600)[0], cases, tolerances
    ):
        (losses, state), (ref_losses, ref_state) = at_cp2, at_cp1
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= tolerance * abs(want), (options, losses, ref_losses)
        for name, want in ref_state.items():
            error = ((state[name] - want).norm() / want.norm()).item()
            assert error <= tolerance, (options, name, error)
