"""Shared by the float8 tests (unit and distributed): a tiny LLaMA whose block linears all qualify
for float8 (every dim, and every tp = 2 shard of one, a multiple of 16), and a one-process run of it
converted by torchao directly, cut into the same microbatches mesh3d's layouts run.

Why the reference is microbatched: float8's dynamic scales come from the amax of each matmul's
input, and a rank only sees its microbatch, so one process over the whole batch would round
differently by design. Cut the same way, every scale is the same (FSDP's float8 all-gather and
torchao's tp styles reduce the amax over the ranks), and what differs is fp32 reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pipeline_cases import SEQ_LEN, VOCAB

from examples.llama.config import ModelArgs
from examples.llama.model import Transformer

GLOBAL_BATCH = 8
MICROBATCHES = 2  # per dp rank: with dp = 2, four chunks of two sequences
CHUNKS = 4
LR = 1e-3
MAX_NORM = 1.0


def float8_args(n_layers: int = 4) -> ModelArgs:
    """dim 64, head dim 16, kv width 32, FFN 128: each linear of a block, whole or halved by tp = 2,
    has both dims divisible by 16."""
    return ModelArgs(
        dim=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        max_seq_len=SEQ_LEN,
        ffn_hidden_dim_override=128,
    )


def block_linears(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")}


def data(steps: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, SEQ_LEN)
    return [
        (torch.randint(0, VOCAB, shape, generator=generator), torch.randint(0, VOCAB, shape, generator=generator))
        for _ in range(steps)
    ]


def one_process(recipe: str | None, batches, chunks: int = CHUNKS, dtype: torch.dtype = torch.float32):
    """Losses, grad norms and the final weights of one process: the model converted by torchao
    (recipe None: not converted), each global batch run as `chunks` microbatches whose token-sum
    losses over the batch's token count add up to the batch's mean loss; AdamW, clipped."""
    model = Transformer(float8_args())
    model.init_weights()
    model.to(dtype)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        names = block_linears(model)
        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets in batches:
        total = 0.0
        for rows in torch.arange(len(inputs)).chunk(chunks):
            logits = model(inputs[rows]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), reduction="sum") / targets.numel()
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def one_process_loss(recipe: str, inputs: torch.Tensor, targets: torch.Tensor, chunks: int = CHUNKS) -> float:
    """The first batch's loss of `one_process`'s model, forward only."""
    model = Transformer(float8_args())
    model.init_weights()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = block_linears(model)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in names)
    with torch.no_grad():
        return (
            sum(
                F.cross_entropy(
                    model(inputs[rows]).float().flatten(0, 1), targets[rows].flatten(), reduction="sum"
                ).item()
                for rows in torch.arange(len(inputs)).chunk(chunks)
            )
            / targets.numel()
        )
