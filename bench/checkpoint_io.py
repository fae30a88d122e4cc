"""Time and size of checkpoints: DCP save and load, safetensors export and import, for one layout.

    python bench/checkpoint_io.py --config 1B                                  # one process (a GPU if present)
    torchrun --standalone --nproc-per-node 8 bench/checkpoint_io.py --pp 2 --dp 2 --tp 2 --config debug
    torchrun --standalone --nproc-per-node 4 bench/checkpoint_io.py --pp 2 --dp 2 --config 495M --stall

Builds the model, takes one AdamW step (so the optimizer has state), then saves a checkpoint
with checksums and one without (`save(..., checksums=False)`), loads each into a fresh model and
optimizer of the same layout (the first verifying its checksums, the second checking sizes only;
checking every value came back), exports Hugging Face safetensors (optionally in bf16) and
imports them. Each save and load runs --repeats times, alternating with and without, and the
fastest is kept. Rank 0 prints the wall times (every rank waits for the slowest), the bytes on
disk, the write/read rates and the checksums' overhead.

--stall measures instead what a save costs the training loop, blocking against async_save:
training steps timed alone (the median is a step's time), then --repeats rounds of a blocking
save (its stall: its time) and an async_save followed by steps (its stall: the time async_save
blocked, the time the steps took beyond as many undisturbed steps, and any wait at the end).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import ModelArgs, get_config  # noqa: E402
from examples.llama.model import Transformer, count_parameters, llama_tp_plan, loss_fn  # noqa: E402
from mesh3d.distributed.shards import local_tensor  # noqa: E402


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(layout, fn) -> float:
    dist.barrier()
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def _build(args, layout):
    layers = {"n_layers": args.n_layers} if args.n_layers else {}
    if args.config in SHAPES:
        config = ModelArgs(**{**SHAPES[args.config], **layers}, max_seq_len=args.seq_len)
    else:
        config = get_config(args.config, max_seq_len=args.seq_len, **layers)
    with torch.device("meta"):
        model = Transformer(config)
    pm = mesh3d.parallelize(model, layout, loss_fn=loss_fn, tp_plan=llama_tp_plan())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    return model, pm, optimizer


def _snapshot(pm, optimizer) -> list[torch.Tensor]:
    tensors = [local_tensor(t.detach()).cpu().clone() for t in pm.state_map.local().values()]
    for state in optimizer.state.values():
        tensors += [local_tensor(v).cpu().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


# The 495M-parameter shape of docs/performance.md (bench/memory_at_scale.py's default model).
SHAPES = {"495M": dict(dim=1536, n_layers=16, n_heads=16, n_kv_heads=4, vocab_size=32000, multiple_of=256)}


def _stall(args, layout, pm, optimizer, step) -> None:
    """The training stall of a save, blocking against async_save (module docstring), printed by rank 0."""

    def timed_step() -> float:
        return _timed(layout, step)

    alone = sorted(timed_step() for _ in range(args.stall_steps))
    step_s = alone[len(alone) // 2]
    root = Path(args.dir or tempfile.gettempdir()) / f"stall-{os.getpid() if layout.rank == 0 else ''}"
    shared = [str(root)]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    first = _timed(layout, lambda: mesh3d.checkpoint.async_save(root / "warm1", pm, optimizer).wait())
    rows = []
    for i in range(args.repeats):
        blocking = _timed(layout, lambda: mesh3d.checkpoint.save(root / f"blocking{i}", pm, optimizer, step=i))
        handle = None

        def start():
            nonlocal handle
            handle = mesh3d.checkpoint.async_save(root / f"async{i}", pm, optimizer, step=i)

        returned = _timed(layout, start)
        steps = [timed_step() for _ in range(max(2, math.ceil(blocking / step_s) + 1))]
        waited = _timed(layout, handle.wait)
        extra = sum(steps) - len(steps) * step_s
        rows.append((blocking, returned, extra, waited, returned + extra + waited, len(steps)))
        if layout.rank == 0:
            gib = _disk_bytes(root / f"blocking{i}") / 1024**3
            for old in root.iterdir():  # each round writes anew, no older files in the page cache to compete
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
    if layout.rank == 0:
        print(f"{layout}\nstep alone {step_s:.2f} s (median of {len(alone)}: {', '.join(f'{t:.2f}' for t in alone)})")
        print(f"checkpoint {gib:.3f} GiB; the first async_save (host copy made, group created): {first:.2f} s")
        print("| round | blocking s | async_save returned s | steps' extra s | wait s | async stall s | / blocking |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for i, (blocking, returned, extra, waited, stall, n) in enumerate(rows):
            print(
                f"| {i + 1} | {blocking:.2f} | {returned:.2f} | {extra:+.2f} ({n} steps) | {waited:.2f} | {stall:.2f} "
                f"| {100 * stall / blocking:.0f} % |",
                flush=True,
            )
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--config", default="debug")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: 2 * dp * pp)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    p.add_argument("--writer-threads", type=int, default=1, help="files each rank writes in parallel")
    p.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2, help="times each save and load runs (the fastest is kept)")
    p.add_argument("--stall", action="store_true", help="the training stall of a save, blocking against async_save")
    p.add_argument("--stall-steps", type=int, default=3, help="steps timed alone for --stall (the median is kept)")
    args = p.parse_args()

    layout = mesh3d.build_mesh(pp=args.pp, dp=args.dp, tp=args.tp)
    is_main = layout.rank == 0
    root = Path(args.dir or (tempfile.mkdtemp(prefix="mesh3d-bench-") if is_main else ""))
    shared = [str(root)]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])

    model, pm, optimizer = _build(args, layout)
    batch = args.batch or 2 * layout.dp * layout.pp
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    share = slice(layout.dp_rank * batch // layout.dp, (layout.dp_rank + 1) * batch // layout.dp)

    def step() -> None:
        pm.step(tokens[share, :-1], tokens[share, 1:])
        optimizer.step()
        optimizer.zero_grad()

    step()
    if args.stall:
        _stall(args, layout, pm, optimizer, step)
        dist.destroy_process_group()
        return
    before = _snapshot(pm, optimizer)

    ckpt, unchecked = root / "ckpt" / "step1", root / "unchecked" / "step1"
    save_s, save_unchecked_s, load_s, load_unchecked_s = [], [], [], []
    _, pm2, optimizer2 = _build(args, layout)
    exact = True
    for _ in range(args.repeats):  # alternating, so that neither side gets all the warm caches
        for path, sums, saves, loads in (
            (unchecked, False, save_unchecked_s, load_unchecked_s),
            (ckpt, True, save_s, load_s),
        ):
            saves.append(
                _timed(
                    layout,
                    lambda: mesh3d.checkpoint.save(
                        path, pm, optimizer, step=1, writer_threads=args.writer_threads, checksums=sums
                    ),
                )
            )
            loads.append(_timed(layout, lambda: mesh3d.checkpoint.load(path, pm2, optimizer2)))
            after = _snapshot(pm2, optimizer2)
            exact = exact and len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    save_s, save_unchecked_s, load_s, load_unchecked_s = map(min, (save_s, save_unchecked_s, load_s, load_unchecked_s))
    flags = torch.tensor([int(exact)], device=layout.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)

    hf = root / "hf"
    dtype = getattr(torch, args.export_dtype)
    export_s = _timed(layout, lambda: mesh3d.checkpoint.export_safetensors(pm2, hf, dtype=dtype))
    import_s = _timed(layout, lambda: mesh3d.checkpoint.import_safetensors(pm2, hf))

    if is_main:
        ckpt_bytes, hf_bytes = _disk_bytes(ckpt), _disk_bytes(hf)
        gib = 1024**3
        print(f"{layout}\nmodel {args.config} ({count_parameters(model) / 1e6:.1f}M parameters), AdamW state")
        print("| operation | wall s | on disk GiB | GiB/s |")
        print("| --- | --- | --- | --- |")
        print(
            f"| save (DCP: model + AdamW + train state, {args.writer_threads} writer threads), checksums "
            f"| {save_s:.2f} | {ckpt_bytes / gib:.3f} | {ckpt_bytes / gib / save_s:.2f} |"
        )
        print(f"| save without checksums | {save_unchecked_s:.2f} | | {ckpt_bytes / gib / save_unchecked_s:.2f} |")
        print(
            f"| load into a fresh model and optimizer, verifying checksums "
            f"| {load_s:.2f} | | {ckpt_bytes / gib / load_s:.2f} |"
        )
        print(
            f"| load without checksums (sizes checked) "
            f"| {load_unchecked_s:.2f} | | {ckpt_bytes / gib / load_unchecked_s:.2f} |"
        )
        print(
            f"| export safetensors ({args.export_dtype}) "
            f"| {export_s:.2f} | {hf_bytes / gib:.3f} | {hf_bytes / gib / export_s:.2f} |"
        )
        print(f"| import safetensors | {import_s:.2f} | | {hf_bytes / gib / import_s:.2f} |")
        print(
            f"checksums' overhead: save +{100 * (save_s / save_unchecked_s - 1):.1f} %, "
            f"load +{100 * (load_s / load_unchecked_s - 1):.1f} % (fastest of {args.repeats})"
        )
        print(f"every model and optimizer value equal after load: {bool(flags.item())}", flush=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
