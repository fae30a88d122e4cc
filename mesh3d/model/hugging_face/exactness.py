"""The check that an architecture's stages compute what its own forward computes.

mesh3d runs a Hugging Face model's own forward on every stage (causal_lm.py), but an architecture
may do work there that a stage would repeat or skip: a multiplier on the embeddings applied to
`inputs_embeds` (then every stage would apply it again), a mask picked by a block's position in the
loop, a module outside the pipeline plan. Rather than trust a list of architectures, mesh3d builds
a small instance of the same architecture (the same config with small sizes: a few blocks of
mixed layer types, a short sliding window), runs it whole and cut into three stages, and refuses
the architecture unless the two agree. Deterministic and local, so every rank decides the same
before any message; cached per architecture and config.
"""

from __future__ import annotations

import copy
import functools
import json

import torch
from torch import nn

from mesh3d.model.cut import cut_stage
from mesh3d.model.hugging_face.causal_lm import hugging_face_anatomy

PROBE_LAYERS = 4
PROBE_HEAD_DIM = 8
PROBE_VOCAB = 64
PROBE_SEQUENCE = 8
TOLERANCE = 1e-6  # the same operations on the same values: any real difference is far above this


def check_stages_exact(model: nn.Module) -> None:
    """Refuse (ValueError naming the architecture and the difference) a model whose stages,
    composed, would not compute its own forward."""
    problem = _stage_problem(type(model), model.config.to_json_string(use_diff=False))
    if problem:
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}): {problem}")


@functools.cache
def _stage_problem(model_class: type, config_json: str) -> str | None:
    config = model_class.config_class.from_dict(json.loads(config_json))
    try:
        small_config = shrunk(config)
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            small = model_class(small_config).float().eval()
            ids = torch.randint(0, small_config.vocab_size, (2, PROBE_SEQUENCE))
    except Exception as error:  # noqa: BLE001 - any failure to build is a reason to refuse
        return (
            f"mesh3d could not build a small instance of this architecture to check that its pipeline stages "
            f"compute what its own forward computes ({type(error).__name__}: {error}); it is refused rather "
            "than trusted"
        )
    anatomy = hugging_face_anatomy(small)
    n_blocks = len(anatomy.blocks(small))
    bounds = sorted({0, min(1, n_blocks - 1), max(n_blocks - 1, 0), n_blocks})
    ranges = [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    try:
        with torch.no_grad():
            whole = small(input_ids=ids, use_cache=False)
            want = whole.logits
            got = (ids,)
            for index, layer_range in enumerate(ranges):
                got = cut_stage(small, anatomy, index, len(ranges), layer_range)(*got)
                got = got if isinstance(got, tuple) else (got,)
            got, *router_sums = got
    except Exception as error:  # noqa: BLE001 - a forward that fails here would fail in the pipeline
        return (
            f"a small instance of this configuration fails to run, whole or cut into pipeline stages "
            f"({type(error).__name__}: {error}); check that transformers runs the configuration itself (e.g. "
            "latent attention needs num_key_value_heads == num_attention_heads)"
        )
    if anatomy.router_aux is not None:
        problem = _router_loss_problem(anatomy.router_aux.loss(router_sums[0]), whole.aux_loss)
        if problem:
            return problem
    if got.shape != want.shape:
        return f"its stages, composed, give logits of shape {tuple(got.shape)}, its forward {tuple(want.shape)}"
    difference = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not difference <= TOLERANCE:
        return (
            f"its forward does work that does not survive a cut into pipeline stages (on a small instance, stages "
            f"composed differ from the model's own forward by {difference:.3g} relative; typically a multiplier "
            "applied to inputs_embeds, which every stage would apply again). mesh3d refuses it rather than train a "
            "different model: write it to the mesh3d protocol (docs/model_protocol.md)"
        )
    return None


def _router_loss_problem(got: torch.Tensor, want) -> str | None:
    """The router loss composed from the stages' sums against the architecture's own `aux_loss`."""
    if not isinstance(want, torch.Tensor):
        return (
            "its config asks for the router's auxiliary loss, but its forward returns none to check mesh3d's against "
            "(aux_loss); set config.output_router_logits = False"
        )
    difference = ((got - want).abs() / want.abs().clamp_min(1e-30)).item()
    if not difference <= TOLERANCE:
        return (
            "its router's auxiliary loss is not transformers' load-balancing loss over every layer's router logits "
            f"(on a small instance, mesh3d's sums over the stages give {got.item():.6g}, "
            f"its forward {want.item():.6g}); "
            "set config.output_router_logits = False to train the cross-entropy alone"
        )
    return None


def shrunk(config):
    """The same architecture's config with small sizes: what the check builds and runs."""
    small = copy.deepcopy(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    group = max(heads // kv_heads, 1)
    new_kv = min(kv_heads, 2)
    new_heads = new_kv * min(group, 2)  # keeps grouped-query attention grouped
    explicit_head_dim = getattr(config, "head_dim", None)
    hidden = new_heads * PROBE_HEAD_DIM
    if explicit_head_dim is not None and explicit_head_dim * heads != config.hidden_size:
        hidden += PROBE_HEAD_DIM  # keeps "head_dim is not hidden_size / heads" so
    sizes = {
        "num_attention_heads": new_heads,
        "hidden_size": hidden,
        "intermediate_size": 3 * PROBE_HEAD_DIM,
        "moe_intermediate_size": 2 * PROBE_HEAD_DIM,
        "shared_expert_intermediate_size": 2 * PROBE_HEAD_DIM,
        "vocab_size": PROBE_VOCAB,
        "num_hidden_layers": min(config.num_hidden_layers, PROBE_LAYERS),
    }
    if hasattr(config, "num_key_value_heads"):
        sizes["num_key_value_heads"] = new_kv
    if explicit_head_dim is not None:
        sizes["head_dim"] = PROBE_HEAD_DIM
    sizes.update(_latent_attention_sizes(config))
    for name in ("num_experts", "num_local_experts"):
        if getattr(config, name, None):
            sizes[name] = min(getattr(config, name), 4)
    if getattr(config, "num_experts_per_tok", None):
        sizes["num_experts_per_tok"] = min(config.num_experts_per_tok, 2)
    if getattr(config, "sliding_window", None):
        sizes["sliding_window"] = PROBE_SEQUENCE // 2  # shorter than the probe: the window masks something
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= PROBE_VOCAB:
            sizes[name] = None if name == "pad_token_id" else 0
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    if kinds:  # every kind of layer, alternating, so stages start on different kinds
        sizes["layer_types"] = [kinds[i % len(kinds)] for i in range(sizes["num_hidden_layers"])]
    for name, value in sizes.items():
        if hasattr(config, name) or name in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size"):
            setattr(small, name, value)
    return small


def _latent_attention_sizes(config) -> dict:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...) sized as one: its config's
    `head_dim` is the rotary part of a query head (`qk_rope_head_dim`), and a query head is the
    rotary and the plain parts together (`qk_head_dim`), so they shrink together; the ranks of the
    latent projections shrink too, and a query without one (`q_lora_rank` None) stays without."""
    if getattr(config, "kv_lora_rank", None) is None or getattr(config, "qk_rope_head_dim", None) is None:
        return {}
    sizes = {
        "qk_rope_head_dim": PROBE_HEAD_DIM,
        "qk_nope_head_dim": PROBE_HEAD_DIM,
        "qk_head_dim": 2 * PROBE_HEAD_DIM,
        "v_head_dim": PROBE_HEAD_DIM // 2,  # unlike a query head, as in every such architecture
        "kv_lora_rank": 2 * PROBE_HEAD_DIM,
    }
    if getattr(config, "q_lora_rank", None) is not None:
        sizes["q_lora_rank"] = 3 * PROBE_HEAD_DIM
    if getattr(config, "head_dim", None) == config.qk_rope_head_dim:
        sizes["head_dim"] = PROBE_HEAD_DIM
    return sizes
