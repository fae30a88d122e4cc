"""Per-rank expert bytes during a step, and step time, against expert parallelism (ep).

    python bench/experts.py --ep 1 2 4
    python bench/experts.py --ep 1 2 4 --world 4 --experts 16 --device cuda   # one GPU per rank

transformers' Qwen3-MoE (hidden 256, 4 layers, 16 experts of width 256, top-2, vocabulary 512,
fp32), on `--world` ranks at (pp, dp) = (1, world) with FSDP, each rank a batch of 4 sequences of
256 tokens per step, at each ep (ep must divide world and the expert count). At ep = 1 every rank
computes every expert (FSDP gathers the whole expert set of a block for its forward); at ep > 1 a
rank holds and computes experts/ep of them, the tokens sent to them all-to-all.

Measured on each rank, in processes of their own per ep (tests/multiprocess.run_on_ranks):

- expert bytes: the bytes of the experts' weights an experts module computes with during its
  forward (what FSDP has gathered then: E x (3 x width x hidden) x 4 bytes at ep = 1, 1/ep of it
  at ep > 1), the largest over the step's forwards, and the same summed over the blocks;
- the median step time of `--steps` steps after one warm-up step.

With more ranks than cores the times measure contention, not ep's speed; the bytes do not depend
on it. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

import mesh3d  # noqa: E402

SEQ, BATCH, VOCAB = 256, 4, 512


def _config(experts: int):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
    )


def _on_rank(ep: int, experts: int, steps: int, device: str | None) -> dict:
    import transformers

    layout = mesh3d.build_mesh(pp=1, ep=ep, device=device)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(experts))
    pm = mesh3d.parallelize(model, layout, schedule="gpipe", microbatches=1, seed=0)
    seen: dict[str, int] = {}

    def measure(name):
        def hook(module, args):
            held = sum(
                p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in module.parameters()
            )
            seen[name] = max(seen.get(name, 0), held)

        return hook

    for stage in pm.stages.values():
        for name, module in stage.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(measure(name))
    generator = torch.Generator().manual_seed(layout.dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.SGD(pm.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        pm.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        if layout.device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    return {"per_module": max(seen.values()), "all_blocks": sum(seen.values()), "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: what build_mesh picks)")
    args = parser.parse_args()
    env = None if args.device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}
    print(f"Qwen3-MoE, {args.experts} experts top-2, world {args.world} at (pp, dp) = (1, {args.world}), FSDP")
    print("| ep | expert bytes per block, during its forward (MiB) | all blocks (MiB) | vs ep = 1 | step (s) |")
    print("| --- | --- | --- | --- | --- |")
    base = None
    for ep in args.ep:
        results = run_on_ranks(_on_rank, args.world, ep, args.experts, args.steps, args.device, timeout=1800, env=env)
        per_module = max(r["per_module"] for r in results)
        all_blocks = max(r["all_blocks"] for r in results)
        step = max(r["step_s"] for r in results)
        base = base or all_blocks
        print(f"| {ep} | {per_module / 2**20:.2f} | {all_blocks / 2**20:.2f} | {all_blocks / base:.3f} | {step:.3f} |")


if __name__ == "__main__":
    main()
