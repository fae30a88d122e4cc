"""The keys and values of the positions a model has already seen, so generation computes each new
token at one position instead of re-running the whole sequence.

    cache = KVCache(model.args, batch_size=1, max_len=prompt_len + new_tokens)
    logits = model(prompt, cache=cache)          # every prompt position, cached
    logits = model(next_token, cache=cache)      # one position, attending to all before it

Training never builds one: `Transformer.forward(tokens)` without a cache is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from examples.llama.config import ModelArgs


@dataclass
class LayerCache:
    """One layer's view of the cache for one forward call: where its new positions start."""

    keys: torch.Tensor  # (batch, kv_heads, max_len, head_dim), shared with the KVCache
    values: torch.Tensor
    start: int

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys and values (batch, kv_heads, new, head_dim) after the cached ones;
        return all of them so far."""
        end = self.start + k.shape[-2]
        self.keys[:, :, self.start : end] = k
        self.values[:, :, self.start : end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Preallocated keys and values of every layer for `batch_size` sequences of up to `max_len` positions.

    `length` counts the positions cached so far; each forward call given the cache takes the next ones.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if max_len > args.max_seq_len:
            raise ValueError(
                f"KVCache: max_len={max_len} exceeds the model's max_seq_len={args.max_seq_len} (its rotary "
                f"table); build the model with max_seq_len >= {max_len}"
            )
        shape = (args.n_layers, batch_size, args.kv_heads, max_len, args.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def take(self, positions: int) -> list[LayerCache]:
        """Each layer's view for a forward call over `positions` new positions, which from now on
        count as cached (the call stores them in every layer)."""
        if self.length + positions > self.max_len:
            raise ValueError(
                f"KVCache: {self.length} cached + {positions} new positions exceed its max_len={self.max_len}; "
                "build the cache with a larger max_len"
            )
        start, self.length = self.length, self.length + positions
        return [LayerCache(self.keys[i], self.values[i], start) for i in range(len(self.keys))]
