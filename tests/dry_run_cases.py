"""One rank of a large world under torch's fake process group (issue 66): build_mesh, parallelize
and two steps, as that rank runs them, with the group creations it made counted.

`dry_rank` runs in a process of its own (multiprocess.run_on_ranks: the harness's rank i plays
`ranks[i]` of `world`), since the fake group is the default group of the whole process.
"""

from __future__ import annotations

import os
import time

import torch

SEQ_LEN = 32  # cp x tp x 2 tokens for the cp layout's sequence parallel: 2 x 8 x 2

# (pp, dp, cp, tp, ep) per layout of the done-when list (ep=1, cp=1: without)
LAYOUTS = {
    "1024 pp dp tp": (1024, dict(pp=8, dp=16, tp=8)),
    "16384 pp dp tp": (16384, dict(pp=16, dp=128, tp=8)),
    "1024 with cp": (1024, dict(pp=4, dp=16, cp=2, tp=8)),
    "1024 with ep": (1024, dict(pp=4, dp=128, tp=2, ep=8)),
}


def sampled_ranks(world: int) -> list[int]:
    """The first, a middle and the last rank: {0, N/2 + 3, N - 1}."""
    return [0, world // 2 + 3, world - 1]


def model(experts: bool, n_layers: int = 16):
    """A model of `n_layers` blocks on meta, tiny in width: the example LLaMA, or with experts a Qwen3-MoE of
    8 experts (expert parallelism needs a model with experts)."""
    if experts:
        import hf_cases

        return hf_cases.meta_hf_model(
            "qwen3_moe", num_experts=8, num_hidden_layers=n_layers, max_position_embeddings=SEQ_LEN
        )
    from examples.llama.config import ModelArgs
    from examples.llama.model import Transformer

    args = ModelArgs(
        dim=64, n_layers=n_layers, n_heads=16, n_kv_heads=8, vocab_size=64, multiple_of=16, max_seq_len=SEQ_LEN
    )
    with torch.device("meta"):
        return Transformer(args)


def dry_rank(layout_name: str) -> dict:
    """Play this harness rank's sampled rank of the layout; what it made and how long it took."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import mesh3d
    from mesh3d.distributed.creation_count import counting_group_creations

    world, sizes = LAYOUTS[layout_name]
    rank = sampled_ranks(world)[int(os.environ["RANK"])]
    start = time.perf_counter()
    with counting_group_creations() as creations:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        layout = mesh3d.build_mesh(**sizes, backend="fake", device="cpu")
        pm = mesh3d.parallelize(model(sizes.get("ep", 1) > 1), layout, microbatches=2 * layout.pp)
        setup_s = time.perf_counter() - start
        vocab = 64
        inputs = torch.randint(3, vocab, (2 * layout.pp, SEQ_LEN))
        losses = [float(pm.step(inputs, inputs.roll(-1, dims=1))) for _ in range(2)]
    return {
        "rank": layout.rank,
        "coordinate": layout.coordinate,
        "world-wide creations": creations["world"],
        "member-only creations": creations["local"],
        "setup s": setup_s,
        "steps": len(losses),
        "local parameters": sum(1 for _ in pm.parameters()),
    }
