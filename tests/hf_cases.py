"""Shared pieces of the Hugging Face tests: tiny configs of real architectures, masked batches, and
the independent reference, transformers' own model in one process on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQ_LEN = 8
VOCAB = 96
STEPS = 2
# Plain SGD: a mathematically zero gradient (a key bias: softmax ignores a shift shared by all keys)
# stays a rounding-sized update, where Adam would blow the rounding up to a step of size lr.
LR = 0.1
TOLERANCE = 1e-5

# Every size tensor parallelism splits (4 heads, 2 kv heads, FFN 96, vocab 96) divides tp = 2.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ARCHITECTURES = {
    # Llama 3 rope scaling, grouped-query attention, tied embeddings
    "llama": dict(
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
    ),
    "qwen2": dict(tie_word_embeddings=True),  # q/k/v biases
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),  # q/k norms; head_dim * heads != hidden_size
    "mistral": dict(tie_word_embeddings=False),
}
# Architectures mesh3d refuses, each for a reason it names: Granite multiplies the embeddings inside
# its forward (every stage would multiply again); GPT-2 declares no base_model_pp_plan.
REFUSED = {
    "granite": dict(embedding_multiplier=12.0, tie_word_embeddings=True),
    "gpt2": dict(tie_word_embeddings=True),
}
# Mixture of experts: 4 experts, 2 per token, packed gate/up experts split over tp (test_hf_experts.py).
MIXTURE_OF_EXPERTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, head_dim=8),
}


# Multi-head latent attention, dense (every block's MLP plain, no experts): heads and kv heads equal,
# as the architecture needs; rotary, plain and value parts of a head all of different sizes.
_LATENT = dict(
    num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=4, v_head_dim=12
)
LATENT_ATTENTION = {
    "minicpm3": _LATENT,
    "deepseek_v3": dict(_LATENT, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2),
    "sarvam_mla": dict(_LATENT, q_lora_rank=None, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2),
}
# xIELU activations: a parameter (act_fn.alpha_p) that the tp plan leaves replicated but that sees
# this rank's slice of the FFN (tensor/partial_gradients.py).
REPLICATED_ON_SHARDS = {"apertus": dict(tie_word_embeddings=False)}


def hf_config(arch: str, **overrides):
    import transformers

    cases = {**ARCHITECTURES, **REFUSED, **MIXTURE_OF_EXPERTS, **LATENT_ATTENTION, **REPLICATED_ON_SHARDS}
    return transformers.AutoConfig.for_model(arch, **{**COMMON, **cases[arch], **overrides})


def meta_hf_model(arch: str, **overrides):
    """The tiny model on the meta device, as a user builds one to be initialized by mesh3d."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(arch, **overrides))


def hf_model(arch: str, seed: int = 0, **overrides):
    """The tiny model with values (CPU, fp32), the same for a seed in every process."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **overrides)).float()
    with torch.no_grad():  # transformers starts biases at zero; values make their relative error meaningful
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.02)
    return model


def masked_batches(batch_size: int, seed: int = 0, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Input ids and next-token targets with some targets -100 (not counted), unevenly per row."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
        targets = ids[:, 1:].clone()
        ids[0, 0] = VOCAB // 2  # the first row of the second vocabulary shard (tp = 2): its lookup and gradient
        targets[torch.rand(targets.shape, generator=generator) < 0.25] = -100
        out.append((ids[:, :-1].contiguous(), targets))
    return out


def packed_batches(batch_size: int, seed: int = 0, steps: int = STEPS):
    """(input ids, targets, {"position_ids"}): each row packs documents of random lengths, positions
    restarting at 0 with each (transformers' own forward reads the restarts as document boundaries);
    the target that crosses into the next document is not counted."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for inputs, targets in masked_batches(batch_size, seed, steps):
        starts = torch.rand(inputs.shape, generator=generator) < 0.3
        starts[:, 0] = True
        index = torch.arange(SEQ_LEN).expand_as(inputs)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
        targets = targets.clone()
        targets[:, :-1][starts[:, 1:]] = -100
        out.append((inputs, targets, {"position_ids": index - first}))
    return out


def padded_batches(batch_size: int, seed: int = 0, steps: int = STEPS):
    """(input ids, targets, {"attention_mask"}): rows of 3..SEQ_LEN tokens, padded on the left (where
    an unmasked pad would be attended to) with pad_token_id; a pad's target is not counted."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for inputs, targets in masked_batches(batch_size, seed, steps):
        lengths = torch.randint(3, SEQ_LEN + 1, (batch_size,), generator=generator)
        lengths[0] = SEQ_LEN  # one row unpadded
        mask = (torch.arange(SEQ_LEN) >= SEQ_LEN - lengths[:, None]).long()
        inputs, targets = inputs.masked_fill(mask == 0, COMMON["pad_token_id"]), targets.masked_fill(mask == 0, -100)
        out.append((inputs, targets, {"attention_mask": mask}))
    return out


def reference_run(arch: str, data, state: dict | None = None, momentum: float = 0.0, **overrides):
    """transformers' model in one process (from `state` when given): losses and the state after every
    step (numpy, by value). A batch may bring a third element, {name: tensor} of inputs the model's
    forward takes (position_ids, attention_mask)."""
    model = hf_model(arch, **overrides)
    if state is not None:
        model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    losses = []
    for inputs, targets, *extra in data:
        logits = model(inputs, **(extra[0] if extra else {}), use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def pipeline_run(arch: str, layout, data, model=None, **parallelize_kwargs):
    """mesh3d's run of `model` (default: hf_model(arch)): losses and the full state after the steps."""
    import mesh3d

    pm = mesh3d.parallelize(hf_model(arch) if model is None else model, layout, **parallelize_kwargs)
    return train_steps(pm, layout, data)


def train_steps(pm, layout, data):
    """SGD steps of `pm`, each dp rank on its share of every batch: losses and the full state after."""
    losses = optimizer_steps(pm, layout, torch.optim.SGD(pm.parameters(), lr=LR), data)
    return losses, pm.full_state_dict()


def optimizer_steps(pm, layout, optimizer, data) -> list[float]:
    """A step of `pm` and `optimizer` per batch, each dp rank on its share: the losses."""
    losses = []
    for inputs, targets, *extra in data:
        share = slice(layout.dp_rank * len(inputs) // layout.dp, (layout.dp_rank + 1) * len(inputs) // layout.dp)
        per_sample = {name: t[share] for name, t in (extra[0] if extra else {}).items()}
        losses.append(pm.step(inputs[share], targets[share], **per_sample).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def worst_error(result, reference) -> tuple[float, str]:
    losses, state = result
    ref_losses, ref_state = reference
    if sorted(state) != sorted(ref_state):
        return float("inf"), f"names differ: {sorted(set(state) ^ set(ref_state))}"
    errors = {f"loss {i}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(losses, ref_losses))}
    for name, want in ref_state.items():
        want = torch.from_numpy(want)
        errors[name] = ((state[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
    where = max(errors, key=errors.get)
    return errors[where], where
