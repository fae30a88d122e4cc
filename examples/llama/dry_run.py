"""train.py --dry-run N: the run these flags describe, played for some ranks of an N-rank job on
this CPU before the GPUs are rented (mesh3d.dry_run: each played rank set up and stepped under
torch's fake process group, in a process of its own), with the planner's bytes beside each rank's
and a verdict line. docs/plan.md, "Before you rent", says what it proves and what it cannot.

    python examples/llama/train.py --dry-run 1024 --pp 4 --tp 8 --global-batch 256 --dry-run-ranks 0 515 1023
"""

from __future__ import annotations

import argparse
import functools
import os

import mesh3d
from examples.llama.model_choice import build_model
from examples.llama.parallel_options import parallelize_options
from examples.llama.text_data import build_tokenizer
from mesh3d.planner.verify_plan import verdict


def meta_model(args: argparse.Namespace):
    """The whole model the flags describe, on meta (built again in each played rank's process)."""
    return build_model(args, build_tokenizer(args))[0]


def dry_run_main(args: argparse.Namespace) -> int:
    """Play --dry-run-ranks of a --dry-run N job; print each rank's report and the verdict; 0 when
    the planner's bytes equal the code's, 1 where they differ."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit(
            "error: --dry-run plays every rank in processes of its own on this machine: run it as one plain "
            "process (python examples/llama/train.py --dry-run N ...), not under torchrun"
        )
    if args.param_dtype is None:  # what the GPU run computes in (arguments.settle_cuda_defaults)
        args.param_dtype = "bf16"
    print(
        f"dry run: ranks {args.dry_run_ranks or 'first, middle and last of each stage'} of {args.dry_run}, "
        f"param_dtype {args.param_dtype}, each set up and stepped on this CPU under torch's fake process group",
        flush=True,
    )
    try:
        reports = mesh3d.dry_run(
            functools.partial(meta_model, args),
            args.dry_run,
            args.dry_run_ranks,
            pp=args.pp,
            dp=args.dp,
            cp=args.cp,
            tp=args.tp,
            ep=args.ep,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            **parallelize_options(args),
        )
    except ValueError as error:
        raise SystemExit(f"error: --dry-run {args.dry_run}: {' '.join(str(error).split())}") from None
    for report in reports:
        print(report.text(), flush=True)
    agreed, line = verdict(reports)
    print(line, flush=True)
    return 0 if agreed else 1
