"""docs/model_protocol.md's complete example, run as the page shows it: the fenced block between
its `own-model-example` markers, executed as a module, its `main` called on 2 ranks at
(pp, tp) = (2, 1) and (1, 2) in one launch. Each run's losses equal the same TinyLM trained in one
process by plain PyTorch (its own `init_weights(seed=0)` on the whole model, AdamW, the same
batches, clipping at 1.0): fp32, relative 1e-5. So the page's model, init and loop are what
mesh3d runs exactly, and a change that breaks the example breaks this test."""

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from multiprocess import run_on_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "model_protocol.md"
LAYOUTS = [(2, 1), (1, 2)]  # (pp, tp)
STEPS = 3


def example() -> dict:
    """The example's module namespace (its `if __name__ == "__main__"` part not run)."""
    found = re.search(
        r"<!-- own-model-example:begin -->\n```python\n(.*?)```\n<!-- own-model-example:end -->", DOC.read_text(), re.S
    )
    assert found, f"{DOC} has no fenced python block between the own-model-example markers"
    namespace = {"__name__": "own_model_example"}
    exec(compile(found.group(1), f"{DOC} (own-model example)", "exec"), namespace)
    return namespace


def _on_rank() -> list[list[float]]:
    main = example()["main"]
    return [main(pp=pp, tp=tp, steps=STEPS) for pp, tp in LAYOUTS]


def reference() -> list[float]:
    """The example's model and loop in one process, without mesh3d."""
    model = example()["TinyLM"]()
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, 256, (8, 33), generator=generator)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_documented_own_model_trains_as_one_process():
    want = reference()
    for rank, runs in enumerate(run_on_ranks(_on_rank, 2, timeout=240)):
        for (pp, tp), losses in zip(LAYOUTS, runs):
            error = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
            assert error <= 1e-5, f"rank {rank} (pp, tp) = ({pp}, {tp}): losses {losses}, one process {want}"
