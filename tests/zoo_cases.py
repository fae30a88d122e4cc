"""The population of transformers' causal LMs mesh3d promises to take: every architecture of the
installed transformers whose config declares a `base_model_pp_plan`, each built tiny from its own
config class, every dropout off; a mixture of experts whose config names a router_aux_loss_coef
with its router's load-balancing loss on (coefficient ROUTER_AUX_COEF), as its users train it. The
one-process reference is transformers' own model (hf_cases.reference_run's pattern): one SGD step
with masked targets (accumulated over the microbatches where the router loss is on).

Shrinking is generic: the usual size attributes are set where the config has them (a hidden size
of 64, 4 layers, 4 heads over 2 kv heads, 4 experts, small latent-attention ranks, ...), layer
kinds alternate so stages begin on different kinds; SHRINK_OVERRIDES holds the few architectures
whose configs name a size their own way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQ_LEN = 8
VOCAB = 96
LR = 0.1
TOLERANCE = 1e-5
HIDDEN = 64
HEAD_DIM = 16
LAYERS = 4
ROUTER_AUX_COEF = 0.1  # the router loss large enough to move the routers' parameters measurably

# Set where the config has the attribute (and its default is not None, for optional sizes).
SIZES = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    # mixture of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    moe_topk=2,
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32,
    expert_ffn_hidden_size=32,
    dense_intermediate_size=96,
    shared_intermediate_size=32,
    ffn_hidden_size=96,
    n_shared_experts=1,
    num_shared_experts=1,
    moe_num_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    first_k_dense_replace=1,
    # latent attention and its indexer
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    v_head_dim=16,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=4,
    # linear attention
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_head_dim=16,
    linear_num_heads=4,
    # the rest
    rotary_dim=8,
    sliding_window=4,
    sliding_window_size=4,
    max_window_layers=2,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=VOCAB,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=HEAD_DIM,
)
OPTIONAL = {"q_lora_rank", "sliding_window", "sliding_window_size", "first_k_dense_replace"}
# Configs that name a size their own way, or whose defaults transformers cannot build.
SHRINK_OVERRIDES: dict[str, dict] = {
    "longcat_flash": dict(num_layers=LAYERS, zero_expert_num=2),  # its depth and identity experts, named its way
    "ministral": dict(head_dim=HEAD_DIM),  # its default head_dim is None, which its attention cannot take
    "dots3_note_text": dict(head_dim=HEAD_DIM),  # its sliding layers' head_dim is qk_nope + qk_rope
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi4_multimodal": dict(  # its vision and audio encoders, built with the model
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        audio_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_blocks=1,
            num_attention_heads=2,
            ext_pw_out_channel=32,
            depthwise_separable_out_channel=32,
            nemo_conv_channels=32,
        ),
    ),
}


def population() -> list[str]:
    """Every causal-LM model type of the installed transformers whose config declares a pipeline plan."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(
        model_type
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if model_type in CONFIG_MAPPING and getattr(CONFIG_MAPPING[model_type], "base_model_pp_plan", None)
    )


def tiny_config(model_type: str):
    """The architecture's own config class, its defaults shrunk, every dropout off."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    aliases = dict(getattr(config_class, "attribute_map", None) or {})  # hidden_size -> n_embd (GPT-J, CodeGen)
    given = {}
    for name, value in SIZES.items():
        own = aliases.get(name, name)
        if own in defaults and not (name in OPTIONAL and defaults[own] is None):
            given[own] = value
    if defaults.get("head_dim") is not None:
        given["head_dim"] = HEAD_DIM
    if defaults.get("kv_lora_rank"):  # latent attention: its rotary part is the head_dim, no kv groups
        given["num_key_value_heads"] = SIZES["num_attention_heads"]
        if "head_dim" in given:
            given["head_dim"] = given["qk_rope_head_dim"]
    if defaults.get("per_layer_config"):  # sizes per layer of the full model: every layer alike
        given["per_layer_config"] = {}
    if defaults.get("num_kv_shared_layers"):  # the last layers reuse the first layers' caches
        given["num_kv_shared_layers"] = LAYERS // 2
    kinds = list(dict.fromkeys(defaults.get("layer_types") or []))
    if kinds:  # every kind of layer, alternating: stages begin on different kinds
        given["layer_types"] = [kinds[i % len(kinds)] for i in range(LAYERS)]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = defaults.get(name)
        if isinstance(value, int) and value >= VOCAB or isinstance(value, list):
            given[name] = None if name == "pad_token_id" else 0
    for name, value in defaults.items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            given[name] = 0.0
    if defaults.get("router_aux_loss_coef") is not None:  # trained as their users train them: with the router loss
        given.update(output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_COEF)
    given.update(SHRINK_OVERRIDES.get(model_type, {}))
    config = config_class(**given)
    for name, value in given.items():  # again as attributes: older configs map their own names only this way
        if not isinstance(getattr(config, name, None), (list, dict)) and not hasattr(
            getattr(config, name, None), "to_dict"
        ):
            setattr(config, name, value)
    return config


def tiny_model(model_type: str, seed: int = 0):
    """The tiny model with values (CPU, fp32), the same in every process for a seed."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
    with torch.no_grad():  # biases start at zero in transformers; values make a difference in them visible
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.02)
    return model


def masked_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and next-token targets, about a quarter of the targets -100 (not counted)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    targets = ids[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=generator) < 0.25] = -100
    return ids[:, :-1].contiguous(), targets


def reference_step(model_type: str, batch, microbatches: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' model in one process, one SGD step: the loss and the state after it. With the
    router's load-balancing loss on, the step accumulates `microbatches` microbatches, each adding
    its cross-entropy sum over the batch's target count and coef x its aux_loss / microbatches."""
    model = tiny_model(model_type)
    inputs, targets = batch
    if getattr(model.config, "output_router_logits", False):
        counted, loss = (targets != -100).sum(), 0.0
        for rows in torch.arange(len(inputs)).chunk(microbatches):
            out = model(inputs[rows], use_cache=False)
            part = F.cross_entropy(out.logits.flatten(0, 1).float(), targets[rows].flatten(), reduction="sum") / counted
            if isinstance(out.aux_loss, torch.Tensor):  # none where no block routes
                part = part + model.config.router_aux_loss_coef * out.aux_loss / microbatches
            part.backward()
            loss += part.item()
        torch.optim.SGD(model.parameters(), lr=LR).step()
        return loss, {k: v.detach().clone() for k, v in model.state_dict().items()}
    logits = model(inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def worst_difference(loss: float, state: dict, reference: tuple[float, dict]) -> tuple[float, str]:
    """The largest relative difference, loss or any parameter after the step, and where."""
    ref_loss, ref_state = reference
    if sorted(state) != sorted(ref_state):
        return float("inf"), f"names differ: {sorted(set(state) ^ set(ref_state))[:4]}"
    errors = {"loss": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)}
    for name, want in ref_state.items():
        got = state[name].to(want.dtype)
        errors[name] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    where = max(errors, key=errors.get)
    return errors[where], where
