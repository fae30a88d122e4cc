"""Per-rank peak resident memory of a model bigger than its ranks' shares, phase by phase (gloo, CPU).

    python bench/memory_at_scale.py                                   # the 501M model, setup, 4 layouts
    python bench/memory_at_scale.py --phases setup step --microbatches 4 16 --seq-len 32

The model is LLaMA-style, built on meta (default dim 1536, 16 layers, vocabulary 32000: about
500M parameters, 1.9 GiB in fp32). Each (layout, phase) runs in processes of its own, so a peak
belongs to one phase: `setup` is `mesh3d.parallelize`; `step` is setup and then two AdamW steps
of 1F1B at each --microbatches count (microbatches of one sample of --seq-len tokens); `io` is a
safetensors export of the sharded model, then its import (each from the resident size before it). Printed per
rank: the peak resident-memory rise (ru_maxrss against the resident size after `build_mesh`), as
a multiple of the rank's share (the model's bytes / (pp·tp·dp) with FSDP, / (pp·tp) with DDP),
and the largest rank's rise against issue 36's bound for setup, 1.25 x share + 256 MiB.
"""

from __future__ import annotations

import argparse
import resource
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(
    model_dims: tuple[int, int, int],
    layout: str,
    phase: str,
    microbatches: int,
    seq_len: int,
    reshard: bool | None = None,
    directory: str | None = None,
) -> dict:
    import mesh3d
    from examples.llama.config import ModelArgs
    from examples.llama.model import Transformer

    dim, n_layers, vocab = model_dims
    pp, dp, tp, dp_mode = layout.split(",")
    pp, dp, tp = int(pp), int(dp), int(tp)
    args = ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=16, n_kv_heads=4, vocab_size=vocab, multiple_of=256, max_seq_len=seq_len
    )
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    layout_ = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    before = _resident()
    extra = {"reshard_after_forward": reshard} if dp_mode == "fsdp" and reshard is not None else {}
    pm = mesh3d.parallelize(
        model, layout_, schedule="1f1b", microbatches=microbatches, dp_mode=dp_mode, seed=0, **extra
    )
    setup_peak = _peak() - before
    if phase == "step":
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):
            tokens = torch.randint(0, vocab, (microbatches, seq_len), generator=generator)
            pm.step(tokens, tokens)
            optimizer.step()
            optimizer.zero_grad()
    share = total / (pp * tp * (dp if dp_mode == "fsdp" else 1))
    result = {"params": total, "share": share, "rise": _peak() - before, "setup_rise": setup_peak}
    if phase == "io":  # export, then import, each measured from the resident size just before it
        for name, run in (
            ("export", lambda: mesh3d.checkpoint.export_safetensors(pm, directory)),
            ("import", lambda: mesh3d.checkpoint.import_safetensors(pm, directory)),
        ):
            start = _resident()
            run()
            result[name] = _peak() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help="pp,dp,tp,dp_mode")
    parser.add_argument("--phases", nargs="+", default=["setup"], choices=["setup", "step", "io"])
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
    args = parser.parse_args()
    dims = (args.dim, args.layers, args.vocab)
    for layout in args.layouts:
        pp, dp, tp = (int(x) for x in layout.split(",")[:3])
        for phase in args.phases:
            for m in args.microbatches if phase == "step" else [max(args.microbatches[0], pp)]:
                reshard = None if args.reshard_after_forward is None else args.reshard_after_forward == "true"
                directory = tempfile.mkdtemp(prefix="memory_at_scale_") if phase == "io" else None
                ranks = run_on_ranks(
                    measure, pp * dp * tp, dims, layout, phase, m, args.seq_len, reshard, directory, timeout=3600
                )
                if directory:
                    shutil.rmtree(directory, ignore_errors=True)
                if phase == "io":
                    for name in ("export", "import"):
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


if __name__ == "__main__":
    main()
