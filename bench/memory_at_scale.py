"""Per-rank peak resident memory of a model bigger than its ranks' shares, phase by phase (gloo, CPU).

    python bench/memory_at_scale.py                                   # the 501M model, setup, 4 layouts
    python bench/memory_at_scale.py --phases setup step --microbatches 4 16 --seq-len 32

The model is LLaMA-style, built on meta (default dim 1536, 16 layers, vocabulary 32000: about
500M parameters, 1.9 GiB in fp32). Each (layout, phase) runs in processes of its own, so a peak
belongs to one phase: `setup` is `mesh3d.parallelize`; `step` is setup and then two AdamW steps
of 1F1B at each --microbatches count (microbatches of one sample of --seq-len tokens); `io` is a
safetensors export of the sharded model, then its import; `checkpoint` is one step, then
`mesh3d.checkpoint.save` with AdamW's state, then `load` (io and checkpoint: each from the
resident size before it, its peak reset). Printed per rank: the peak resident-memory rise
(VmHWM, ru_maxrss's figure, against the resident size after `build_mesh`), as a multiple of the
rank's share (the model's bytes / (pp·tp·dp) with FSDP, / (pp·tp) with DDP), and the largest
rank's rise against issue 36's bound for setup, 1.25 x share + 256 MiB; for a step, against the
peak `mesh3d.plan` predicts with the layout pinned. The step uses AdamW's foreach kernels
(torch's default on CUDA, which the planner counts). `--track` adds the peak of live tensor bytes
from the profiler's memory events (LiveTensorTracker): the planner counts tensors, resident
memory adds the allocator's slack; the profiler's own memory inflates that run's resident figures.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

LAYOUTS = ["2,2,1,fsdp", "1,4,1,fsdp", "2,1,2,fsdp", "4,1,1,fsdp"]
MIB = 2**20


def _resident() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """The process's peak resident size (Linux's VmHWM, ru_maxrss's figure, but resettable)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def _reset_peak() -> None:
    """Start the peak afresh from the current resident size (Linux's clear_refs 5): a phase after a
    step is measured without the step's peak."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _model(model_dims: tuple[int, int, int], seq_len: int) -> torch.nn.Module:
    """The LLaMA example's model of these (dim, layers, vocabulary), on meta."""
    from examples.llama.config import ModelArgs
    from examples.llama.model import Transformer

    dim, n_layers, vocab = model_dims
    args = ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=16, n_kv_heads=4, vocab_size=vocab, multiple_of=256, max_seq_len=seq_len
    )
    with torch.device("meta"):
        return Transformer(args)


class LiveTensorTracker:
    """The peak of the bytes torch's allocator holds for tensors, from the profiler's memory events.

    Resident memory also counts the allocator's slack and everything that is not a tensor; this
    counts tensors alone, as the planner does. Only what is allocated after `start` is seen."""

    def __enter__(self) -> LiveTensorTracker:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = self.peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            self.peak = max(self.peak, live)


def measure(
    model_dims: tuple[int, int, int],
    layout: str,
    phase: str,
    microbatches: int,
    seq_len: int,
    reshard: bool | None = None,
    directory: str | None = None,
    track: bool = False,
) -> dict:
    import mesh3d

    vocab = model_dims[2]
    pp, dp, tp, dp_mode = layout.split(",")
    pp, dp, tp = int(pp), int(dp), int(tp)
    model = _model(model_dims, seq_len)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    layout_ = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    tracker = LiveTensorTracker() if track else contextlib.nullcontext()
    tracker.__enter__()
    before = _resident()
    extra = {"reshard_after_forward": reshard} if dp_mode == "fsdp" and reshard is not None else {}
    pm = mesh3d.parallelize(
        model, layout_, schedule="1f1b", microbatches=microbatches, dp_mode=dp_mode, seed=0, **extra
    )
    setup_peak = _peak() - before
    if phase in ("step", "checkpoint"):
        # foreach: torch's default on CUDA, what the planner counts (CPU's default is one tensor at a time)
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2 if phase == "step" else 1):
            tokens = torch.randint(0, vocab, (microbatches, seq_len), generator=generator)
            pm.step(tokens, tokens)
            optimizer.step()
            optimizer.zero_grad()
    share = total / (pp * tp * (dp if dp_mode == "fsdp" else 1))
    result = {"params": total, "share": share, "rise": _peak() - before, "setup_rise": setup_peak}
    tracker.__exit__(None, None, None)
    if track:
        result["tensors"] = tracker.peak
    runs = {  # each measured from the resident size just before it
        "io": (
            ("export", lambda: mesh3d.checkpoint.export_safetensors(pm, directory)),
            ("import", lambda: mesh3d.checkpoint.import_safetensors(pm, directory)),
        ),
        "checkpoint": (  # after one step: AdamW's moments are saved and loaded too
            ("save", lambda: mesh3d.checkpoint.save(f"{directory}/step1", pm, optimizer)),
            ("load", lambda: mesh3d.checkpoint.load(f"{directory}/step1", pm, optimizer)),
        ),
    }
    if phase in runs:
        for name, run in runs[phase]:
            _reset_peak()
            start = _resident()
            run()
            result[name] = _peak() - start
    return result


def predicted_peak(
    model_dims: tuple[int, int, int], layout: str, microbatches: int, seq_len: int, reshard: bool | None
) -> int:
    """mesh3d.plan's peak bytes per rank for this layout pinned (1F1B, microbatches of one sample, fp32)."""
    import mesh3d

    pp, dp, tp, dp_mode = layout.split(",")
    pp, dp, tp = int(pp), int(dp), int(tp)
    fix = dict(
        pp=pp, dp=dp, tp=tp, dp_mode=dp_mode, schedule="1f1b", virtual_stages=1, microbatches=microbatches,
        activation_checkpoint="never", param_dtype=None, compile=False,
    )  # fmt: skip
    if reshard is not None:
        fix["reshard_after_forward"] = reshard
    plans = mesh3d.plan(
        _model(model_dims, seq_len), gpus=pp * dp * tp, gpus_per_node=pp * dp * tp, seq_len=seq_len,
        global_batch=microbatches * dp, fix=fix, memory_limit=2**60,
    )  # fmt: skip
    return plans[0].memory_per_rank.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help="pp,dp,tp,dp_mode")
    parser.add_argument("--phases", nargs="+", default=["setup"], choices=["setup", "step", "io", "checkpoint"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--reshard-after-forward",
        choices=["true", "false"],
        default=None,
        help="FSDP's reshard_after_forward (default: parallelize's, False when pp > 1)",
    )
    parser.add_argument("--track", action="store_true", help="also the peak of live tensor bytes (the profiler's)")
    args = parser.parse_args()
    dims = (args.dim, args.layers, args.vocab)
    for layout in args.layouts:
        pp, dp, tp = (int(x) for x in layout.split(",")[:3])
        for phase in args.phases:
            for m in args.microbatches if phase == "step" else [max(args.microbatches[0], pp)]:
                reshard = None if args.reshard_after_forward is None else args.reshard_after_forward == "true"
                directory = tempfile.mkdtemp(prefix="memory_at_scale_") if phase in ("io", "checkpoint") else None
                planned = predicted_peak(dims, layout, m, args.seq_len, reshard) if phase == "step" else None
                ranks = run_on_ranks(
                    measure, pp * dp * tp, dims, layout, phase, m, args.seq_len, reshard, directory, args.track,
                    timeout=3600,
                )  # fmt: skip
                if directory:
                    shutil.rmtree(directory, ignore_errors=True)
                if phase in ("io", "checkpoint"):
                    for name in ("export", "import") if phase == "io" else ("save", "load"):
                        rises = [r[name] for r in ranks]
                        print(
                            f"{layout:>11} {name:>10}: peak rise per rank {', '.join(f'{r / MIB:.0f}' for r in rises)} "
                            f"MiB = share + {(max(rises) - ranks[0]['share']) / MIB:.0f} MiB",
                            flush=True,
                        )
                    continue
                share = ranks[0]["share"]
                rises = [r["rise"] for r in ranks]
                label = phase if phase == "setup" else f"step m={m}"
                if reshard is not None:
                    label += f" reshard={reshard}"
                print(
                    f"{layout:>11} {label:>10}: model {ranks[0]['params'] / 4e6:.0f}M params, "
                    f"share {share / MIB:.0f} MiB; "
                    f"peak rise per rank {', '.join(f'{r / MIB:.0f}' for r in rises)} MiB "
                    f"= {max(rises) / share:.2f}x share "
                    f"(bound 1.25x + 256 MiB = {(1.25 * share + 256 * MIB) / MIB:.0f} MiB)",
                    flush=True,
                )
                if args.track:
                    tensors = [r["tensors"] for r in ranks]
                    print(f"{'':>24}live tensors per rank {', '.join(f'{t / MIB:.0f}' for t in tensors)} MiB")
                if planned is not None:
                    for what, got in (("rise", max(rises)), ("tensors", max(tensors) if args.track else None)):
                        if got is not None:
                            print(
                                f"{'':>24}planner {planned / MIB:.0f} MiB: {100 * (planned - got) / got:+.0f} % "
                                f"of the largest {what}"
                            )


if __name__ == "__main__":
    main()
