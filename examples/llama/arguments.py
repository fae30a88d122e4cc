"""train.py's command line: every flag, `--config-file`'s settings under them, the checks between flags
(flag_checks.py), and the defaults that depend on other settings.

A bad flag is reported by rank 0 alone (every rank parses the same command line, so every rank
finds the same problem): under torchrun the message appears once, not once per process.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import NoReturn

import torch

import mesh3d
from examples.llama import hf_model
from examples.llama.config import CONFIGS
from examples.llama.flag_checks import check_flags
from examples.llama.profiling import DEFAULT_STEPS, profile_window
from examples.llama.run_config import config_file_argv
from mesh3d.data_parallel import DP_MODES
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES

# The library's defaults, so the flags cannot drift from parallelize's signature.
LIBRARY_DEFAULTS = {name: p.default for name, p in inspect.signature(mesh3d.parallelize).parameters.items()}

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def is_rank_zero() -> bool:
    """Rank 0 of a torchrun job, or a plain process; known before any process group exists."""
    return os.environ.get("RANK", "0") == "0"


class Parser(argparse.ArgumentParser):
    """argparse, but only rank 0 prints the usage and the error; every rank exits with status 2."""

    def error(self, message: str) -> NoReturn:
        if is_rank_zero():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """--help as written (the description's layout kept), each flag's line ending with its default
    where the default is a value: not where it is None or a switch's False (the help says what
    then happens), nor where the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in help or not action.option_strings:
            return help
        return f"{help} (default: %(default)s)"


def build_parser(description: str | None = None) -> Parser:
    """Every flag of train.py."""
    p = Parser(description=description, formatter_class=HelpWithDefaults)
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=-1, help="data-parallel degree (-1: the rest of the world)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each sequence cut over N ranks, which share their dp rank's rows "
        "(--seq-len a multiple of 2*N)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (consecutive ranks, one node)")
    p.add_argument(
        "--expert-bias-rate",
        type=float,
        default=0.0,
        help="DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's e_score_correction_bias "
        "moves by this much toward the experts' mean load (DeepSeek-V3: 0.001; 0: off, as transformers trains)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree: each block's experts split over N ranks of a stage (N divides dp*cp*tp "
        "and the expert count; a --hf-model mixture of experts with a base_model_ep_plan)",
    )
    p.add_argument(
        "--schedule",
        default=LIBRARY_DEFAULTS["schedule"],
        choices=sorted(mesh3d.pipeline.SCHEDULES),
        help="the pipeline schedule (docs/pipeline.md)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="per step and dp rank (default: pp)")
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="stages per pp rank (default: the schedule's, see docs/pipeline.md)",
    )
    p.add_argument(
        "--layers-per-stage",
        type=int,
        nargs="+",
        default=None,
        help="blocks per stage, pp x virtual stages of them (e.g. 0 2 2 0); the first and last may be 0: "
        "the embedding, the head and loss alone (default: balanced)",
    )
    p.add_argument(
        "--dp-mode", default=LIBRARY_DEFAULTS["dp_mode"], choices=list(DP_MODES), help="how dp ranks hold the model"
    )
    p.add_argument(
        "--dp-shard",
        type=int,
        default=None,
        help="with --dp-mode hsdp: the dp ranks that shard the parameters among them (a node's), replicas across",
    )
    p.add_argument(
        "--activation-checkpoint",
        default=LIBRARY_DEFAULTS["activation_checkpoint"],
        choices=list(ACTIVATION_CHECKPOINT_MODES),
        help="which blocks' activations are recomputed in the backward",
    )
    p.add_argument("--loss-parallel", action="store_true", help="keep logits vocab-sharded over tp for the loss")
    p.add_argument(
        "--float8",
        choices=["tensorwise", "rowwise"],
        default=None,
        help="the blocks' linears in float8 through torchao (pip install 'mesh3d[float8]')",
    )
    p.add_argument(
        "--fused-loss",
        action="store_true",
        help="run the output head and the loss together, a chunk of rows at a time: no whole logits (tp 1)",
    )
    p.add_argument(
        "--param-dtype",
        default=None,
        choices=sorted(PARAM_DTYPES),
        help="compute dtype (default: bf16 on CUDA, fp32 on CPU); bf16 keeps fp32 master weights, reduces "
        "gradients in fp32",
    )
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, fp32 matmuls run on TF32 tensor cores (torch.backends.cuda.matmul.fp32_precision); "
        "--no-tf32 keeps them full fp32",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (inductor)")
    p.add_argument(
        "--document-mask",
        action="store_true",
        help="packed documents: attention stays inside each document (block-causal) and positions restart at "
        "each one; documents end at the tokenizer's end-of-document token (the example's LLaMA model)",
    )
    p.add_argument(
        "--placement-report", default=None, help="rank 0 writes each rank's node and mesh coordinate here (JSON)"
    )
    p.add_argument("--config", default="debug", choices=sorted(CONFIGS), help="the model's sizes")
    p.add_argument("--n-layers", type=int, default=None, help="override the config's number of layers")
    p.add_argument("--dim", type=int, default=None, help="override the config's model width")
    p.add_argument("--n-heads", type=int, default=None, help="override the config's attention heads")
    p.add_argument("--n-kv-heads", type=int, default=None, help="override the config's key/value heads")
    p.add_argument(
        "--n-experts",
        type=int,
        default=None,
        help=f"--hf-model ARCH, a mixture of experts: routed experts per block (default {hf_model.EXPERTS}, "
        "or the architecture's own count where smaller)",
    )
    p.add_argument(
        "--router-aux-loss",
        type=float,
        default=None,
        metavar="COEF",
        help="--hf-model, a mixture of experts: train with the router's load-balancing loss, COEF times it "
        "added to the cross-entropy (the config's output_router_logits and router_aux_loss_coef; default: "
        "as the config says, off for an architecture's); the metrics carry router_aux",
    )
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie embedding and output")
    p.add_argument(
        "--steps", type=int, default=200, help="optimizer steps (a resumed run counts from its checkpoint's)"
    )
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks together")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument(
        "--lr-schedule-steps",
        type=int,
        default=None,
        metavar="N",
        help="the step at which the cosine decay ends (default: --steps; on --resume, the checkpoint's, so "
        "raising --steps extends a run at the final lr unless this is given)",
    )
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices (none on norm gains)")
    p.add_argument(
        "--grad-clip",
        type=float,
        default=None,
        help="max global grad norm; 0 disables clipping (default 1.0; off, and refused, with the "
        "never-drain schedules pipedream and pipedream_2bw)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    p.add_argument(
        "--data",
        nargs="*",
        default=None,
        help=".txt/.jsonl/.parquet files, directories and globs (default: the stdlib corpus)",
    )
    p.add_argument("--text-field", default="text", help="the JSONL field / Parquet column holding each document")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Hugging Face tokenizer.json (default: --init-from-hf's tokenizer.json, else bytes)",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="the --tokenizer token that ends each document (default: the one it declares)",
    )
    p.add_argument("--tokenize-workers", type=int, default=None, help="processes that tokenize (default: CPUs, <= 8)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary (default: the tokenizer's, padded to a multiple of 64 and of --tp)",
    )
    p.add_argument("--eval-every", type=int, default=0, help="evaluate on held-out data every N steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches held out (by --seed) and evaluated")
    p.add_argument("--token-file", default=None, help="a pre-tokenized .npy (or raw, with --token-dtype) file")
    p.add_argument("--token-dtype", default=None, help="a raw --token-file's dtype (e.g. uint16; a .npy says its own)")
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="read the loss, grad norm and memory and print a line every N steps; the steps between read "
        "nothing from the device",
    )
    p.add_argument("--metrics", default="runs/train.jsonl", help="JSONL file, one line per step")
    p.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="also log the metrics as TensorBoard scalars here"
    )
    p.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log the metrics to this Weights & Biases project (WANDB_MODE=offline: without an account)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write torch profiler traces of --profile-steps here, DIR/rank<R>.json (and a CUDA memory snapshot)",
    )
    p.add_argument(
        "--profile-steps",
        type=profile_window,
        default=DEFAULT_STEPS,
        metavar="A:B",
        help="the steps --profile records, from 1 (default 2:3: past the first step's one-time work)",
    )
    p.add_argument(
        "--predict-memory",
        action="store_true",
        help="print mesh3d.plan's memory prediction for this layout beside the first step's peak "
        "(always on CUDA; on the CPU the resident peak also holds the interpreter)",
    )
    p.add_argument(
        "--config-file",
        default=None,
        metavar="TOML",
        help="settings under the flags' long names with underscores; the command line overrides them",
    )
    p.add_argument(
        "--dry-run",
        type=int,
        default=None,
        metavar="N",
        help="play some ranks of an N-rank job of these flags on this CPU (mesh3d.dry_run, torch's fake process "
        "group), print what each holds and sends beside the planner's figures, and exit (0: they agree)",
    )
    p.add_argument(
        "--dry-run-ranks",
        type=int,
        nargs="+",
        default=None,
        metavar="RANK",
        help="the ranks --dry-run plays (default: the first, a middle and the last of each pipeline stage)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here, as DIR/step<N>")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (and after the last step)")
    p.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints")
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="write each checkpoint in the background while training goes on (mesh3d.checkpoint.async_save; "
        "one host copy of the rank's model and optimizer state)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir that loads, if any (and append to --metrics)",
    )
    p.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="continue from exactly this checkpoint (an error if it is missing or damaged; appends to --metrics)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a collective or P2P wait may last before the job fails (a stopped rank); "
        "default 600, Megatron's --distributed-timeout-minutes 10",
    )
    p.add_argument(
        "--max-bad-steps",
        type=int,
        default=3,
        help="stop after this many optimizer steps in a row skipped for a non-finite gradient norm",
    )
    p.add_argument(
        "--init-from-hf",
        default=None,
        metavar="DIR",
        help="model config and weights from a Hugging Face Llama directory (config.json + safetensors)",
    )
    p.add_argument(
        "--hf-model",
        default=None,
        metavar="DIR_OR_ARCH",
        help="train a Hugging Face model as transformers builds it: a directory with a config.json (its "
        "weights too, when there) or a model type (qwen2, llama, ...) at --config's sizes",
    )
    p.add_argument(
        "--export-hf", default=None, metavar="DIR", help="after training, write the model as Hugging Face safetensors"
    )
    return p


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """train.py's settings: `--config-file`'s, then the command line's; a bad one exits (status 2)."""
    p = build_parser(description)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(config_file_argv(p, argv) + argv)
    check_flags(p, args)
    args.grad_clip = _grad_clip(p, args)
    return args


def settle_cuda_defaults(args: argparse.Namespace, device: torch.device) -> None:
    """The defaults that depend on the device, once it is known: the compute dtype (bf16 on CUDA,
    fp32 elsewhere) and, on CUDA, TF32 for fp32 matmuls unless --no-tf32."""
    on_cuda = torch.device(device).type == "cuda"
    if args.param_dtype is None:
        args.param_dtype = "bf16" if on_cuda else "fp32"
    if on_cuda:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if args.tf32 else "ieee"


def never_drains(schedule: str) -> bool:
    """Whether the schedule updates the weights inside the pipeline (pipedream, pipedream_2bw)."""
    return mesh3d.pipeline.SCHEDULES[schedule].never_drains


def _grad_clip(p: Parser, args: argparse.Namespace) -> float:
    """--grad-clip, its default resolved by the schedule: 1.0 where a step drains, 0 (off) where it never does."""
    if not never_drains(args.schedule):
        return 1.0 if args.grad_clip is None else args.grad_clip
    if args.grad_clip is not None and args.grad_clip > 0:
        p.error(
            f"--grad-clip {args.grad_clip} cannot apply with --schedule {args.schedule}: its stages update at "
            "different times, so no whole gradient exists to clip by its global norm; leave --grad-clip out "
            "(or pass --grad-clip 0)"
        )
    return 0.0
