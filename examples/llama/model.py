"""A LLaMA-style decoder that follows mesh3d's model protocol (see docs/model_protocol.md).

- Repeated blocks live in `self.layers`, an nn.ModuleDict keyed "0".."L-1".
- `tok_embeddings` is registered before `layers` (first stage); `norm` and `output` after (last).
- `forward` tolerates any of those being None and `layers` holding only some keys, so the same
  class runs the whole model or one pipeline stage.
- Head counts come from tensor shapes at run time, so one code path runs full or TP-local heads.
- Rotary embeddings use the rotate-half convention of Hugging Face's Llama (no complex numbers):
  attention.py, with the attention layer and its masks.
- Packed documents: `document_ids` (a per-sample input, keyword-only, so every pipeline stage is
  handed it) makes attention block-causal, and positions restart with each document.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from examples.llama.attention import Attention, block_causal_mask, rope_cache
from examples.llama.config import ModelArgs
from examples.llama.hf_adapter import LlamaHFAdapter
from examples.llama.kv_cache import KVCache, LayerCache
from mesh3d.data.documents import positions_in_documents
from mesh3d.distributed.shards import local_tensor, local_window

INIT_STD = 0.02


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Training calls stay (x, rope) positionally: the tensor-parallel plan prepares those; the rest by keyword.
        extra = ({} if cache is None else {"cache": cache}) | ({} if mask is None else {"mask": mask})
        h = x + self.attention(self.attention_norm(x), rope, **extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """LLaMA-style decoder: embeddings -> blocks -> RMSNorm -> output head, optionally tied."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # Declared for mesh3d, which checks token ids and targets against it: padding rows are never either.
        self.vocab_size = args.tokenizer_vocab_size or args.vocab_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, never saved: rebuilt whenever the model gets real memory.
        self.register_buffer("rope", rope_cache(args), persistent=False)
        self.tp_plan = llama_tp_plan()
        # Per-sample inputs that index (mesh3d checks them): position ids index the rotary table,
        # and a row of max_seq_len tokens holds at most that many documents.
        self.input_index_bounds = {"position_ids": args.max_seq_len, "document_ids": args.max_seq_len}

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab); a middle stage maps hidden -> hidden.

        `cache` (generation, whole model only): `tokens` are the positions after the cached ones;
        their keys and values are added to it (examples/llama/kv_cache.py).
        `document_ids` (batch, seq): packed documents (mesh3d.data.documents): a token attends only
        to earlier tokens of its own document, and positions restart with each document.
        `position_ids` (batch, seq): each token's rotary position (default: 0.. per row, or per
        document where `document_ids` are given).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if document_ids is not None or position_ids is not None:
            if cache is not None:
                raise ValueError(
                    "document_ids and position_ids are for training: generation with a cache takes neither"
                )
            mask = block_causal_mask(document_ids) if document_ids is not None else None
            if position_ids is None:
                if tokens.shape[1] > self.args.max_seq_len:
                    raise ValueError(
                        f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len={self.args.max_seq_len}; "
                        f"build the model with max_seq_len >= {tokens.shape[1]}"
                    )
                position_ids = positions_in_documents(document_ids)
            rope = self.rope[position_ids]  # (batch, seq, 2, head_dim): each token's row
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        elif cache is None:
            for layer in self.layers.values():
                h = layer(h, self.rope)
        else:
            for layer, layer_cache in zip(self.layers.values(), cache.take(tokens.shape[1]), strict=True):
                h = layer(h, self.rope, cache=layer_cache)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def hf_adapter(self) -> LlamaHFAdapter:
        """Its names and config as transformers' LlamaForCausalLM's.

        mesh3d.checkpoint's safetensors export and import ask it."""
        return LlamaHFAdapter(self.args)

    def tensor_parallel_sizes(self) -> dict[str, int]:
        """Sizes the tensor-parallel degree must divide (mesh3d checks them before sharding)."""
        a = self.args
        return {
            "n_heads": a.n_heads,
            "n_kv_heads": a.kv_heads,
            "ffn_hidden_dim": a.ffn_hidden_dim,
            "vocab_size": a.vocab_size,
        }

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        """Materialize from meta; the rotary table is recomputed, parameters stay uninitialized.

        nn.Module.to_empty gives every module its own new Parameter, which silently unties a
        shared weight: the tie is restored here.
        """
        super().to_empty(device=device, recurse=recurse)
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        self.init_buffers()
        return self

    @torch.no_grad()
    def init_buffers(self) -> None:
        self.rope = rope_cache(self.args, device=self.rope.device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter this (possibly partial, possibly sharded) model holds, deterministically.

        A parameter's values come in chunks of whole rows (INIT_CHUNK elements at most), each drawn
        from its own generator seeded by `seed`, the parameter's name in the whole model and the
        chunk's index. The values therefore depend on nothing but the name, so a pipeline stage gets
        exactly the values the unsplit model would; and a rank holding a shard (tensor or data
        parallelism) draws only the chunks its shard overlaps, never the whole tensor. A tied
        output head draws the embedding's values. Buffers are `to_empty`'s job.
        """
        for name, param in self.named_parameters():
            name = canonical_name(name)
            key = "tok_embeddings.weight" if self.args.tie_embeddings and name == "output.weight" else name
            if key.endswith("norm.weight"):
                local_tensor(param).detach().fill_(1.0)
                continue
            # Residual-branch outputs shrink with depth so the residual stream keeps its scale.
            residual = key.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
            std = INIT_STD / math.sqrt(2 * self.args.n_layers) if residual else INIT_STD
            _fill_by_chunks(param, _seed_for(seed, key), std)


INIT_CHUNK = 2**20  # elements per independently seeded chunk of a parameter: bounds init's transient memory


@torch.no_grad()
def _fill_by_chunks(param: torch.Tensor, seed: int, std: float) -> None:
    """This rank's window of a truncated-normal tensor drawn chunk by chunk of whole rows."""
    window = local_window(param)
    if window is None:
        return
    local = local_tensor(param).detach()
    shape = tuple(param.shape)
    row = math.prod(shape[1:])
    rows_per_chunk = max(1, INIT_CHUNK // max(row, 1))
    first, stop = window[0].start, window[0].stop
    for chunk in range(first // rows_per_chunk, (stop - 1) // rows_per_chunk + 1):
        begin, end = chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, shape[0])
        generator = torch.Generator().manual_seed((seed + chunk * 7_919) % (2**63))
        values = torch.empty((end - begin, *shape[1:]), dtype=torch.float32)
        nn.init.trunc_normal_(values, std=std, a=-3 * std, b=3 * std, generator=generator)
        lo, hi = max(begin, first), min(end, stop)
        part = values[(slice(lo - begin, hi - begin), *window[1:])]
        local[lo - first : hi - first].copy_(part.to(local.device, local.dtype))


# Wrappers (activation checkpointing, torch.compile, FSDP1) insert these into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain, unwrapped model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions of one batch whose target is not -100.

    The one-process form. Through mesh3d, leave `loss_fn` out: its default is the same loss as a
    (sum, count) pair, which stays the global token mean when microbatches count different numbers
    of positions (this mean, averaged over microbatches, would not).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def llama_tp_plan(loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Tensor-parallel plan with sequence parallel: module-name patterns -> torch ParallelStyles.

    Activations between blocks (and between pipeline stages) are sharded along the sequence;
    embedding and output head both shard the vocabulary, so a tied weight has aligned shards.
    """
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
