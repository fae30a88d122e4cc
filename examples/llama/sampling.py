"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k and top-p.

    next_ids = sample(logits, Sampling(temperature=0.8, top_k=50, top_p=0.9), generator)

Top-k keeps the k most likely tokens; top-p (nucleus sampling) keeps the fewest most likely
tokens whose probabilities add up to at least p. Both apply to the temperature-scaled
distribution, and the most likely token always stays, so neither can leave nothing to draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (the most likely token, no randomness).

    top_k: keep only the k most likely tokens (None: all). top_p: keep the fewest most likely tokens
    whose probabilities sum to at least top_p (None or 1.0: all).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"Sampling: temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"Sampling: top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling: top_p must be None or in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def restrict(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (..., vocab) with every token outside the top-k / top-p set at -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # A token stays when the tokens more likely than it sum to less than top_p: the first always does.
        before = probs.cumsum(dim=-1) - probs
        drop = before >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: logits (batch, vocab) -> ids (batch,)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = restrict(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
