"""The checks between train.py's flags (arguments.py parses them): a combination that cannot run is
refused by name, through the parser's `error` (rank 0 reports it, every rank exits with status 2),
before any process group starts.
"""

from __future__ import annotations

import argparse

from examples.llama import hf_model
from examples.llama.batch_sizes import batch_split_problem, resolved_dp, seq_len_problem
from examples.llama.tensorboard_log import tensorboard_available
from examples.llama.wandb_log import wandb_available


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check between the flags, in order; the first that fails exits through `p.error`."""
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and args.resume_from:
        p.error("--resume takes the newest checkpoint, --resume-from a chosen one: pass one of them")
    if (args.checkpoint_every or args.keep_last is not None or args.async_checkpoint) and not args.checkpoint_dir:
        p.error("--checkpoint-every, --keep-last and --async-checkpoint need --checkpoint-dir")
    if args.timeout <= 0 or args.max_bad_steps < 1 or args.log_every < 1:
        p.error("--timeout must be > 0, --max-bad-steps >= 1 and --log-every >= 1")
    if args.checkpoint_every < 0 or (args.keep_last is not None and args.keep_last < 1):
        p.error("--checkpoint-every must be >= 0 and --keep-last >= 1")
    shape_flags = given_shape_flags(args)
    if args.init_from_hf and shape_flags:
        p.error(f"--init-from-hf takes the model's shape from its config.json; drop {'/'.join(shape_flags)}")
    if args.n_experts is not None and (not args.hf_model or hf_model.is_directory(args.hf_model)):
        p.error("--n-experts sets the experts of --hf-model ARCH (an architecture at --config's sizes); drop it")
    if args.n_experts is not None and args.n_experts < 1:
        p.error(f"--n-experts must be >= 1, got {args.n_experts}")
    if args.router_aux_loss is not None and (not args.hf_model or args.router_aux_loss < 0):
        p.error(f"--router-aux-loss {args.router_aux_loss} needs --hf-model (a mixture of experts) and COEF >= 0")
    if not args.init_from_hf and not (args.hf_model and hf_model.is_directory(args.hf_model)):
        problem = model_shape_problem(args)
        if problem:
            p.error(problem)
    if args.hf_model:
        _check_hf_model(p, args)
    if args.eval_every < 0 or args.eval_batches < 1:
        p.error("--eval-every must be >= 0 and --eval-batches >= 1")
    if args.token_file and (args.tokenizer or args.data):
        p.error("--token-file is already tokenized: drop --tokenizer/--data")
    if args.document_mask and args.hf_model:
        p.error("--document-mask is the example's LLaMA model's (its document_ids input); drop it or --hf-model")
    if args.profile and args.profile_steps.last > args.steps:
        last = args.steps
        p.error(f"--profile-steps {args.profile_steps} ends after --steps {last}; profile steps up to {last}")
    if args.tensorboard and not tensorboard_available():
        p.error("--tensorboard needs the tensorboard package: pip install tensorboard")
    if args.wandb and not wandb_available():
        p.error("--wandb needs the wandb package: pip install wandb")
    if args.lr_schedule_steps is not None and args.lr_schedule_steps < 1:
        p.error(f"--lr-schedule-steps must be >= 1, got {args.lr_schedule_steps}")
    _check_batch_split(p, args)
    problem = seq_len_problem(args.seq_len, args.cp)
    if problem:
        p.error(problem)


def _check_batch_split(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--global-batch over --dp (the ranks of a cp group share their dp rank's rows), then into
    --microbatches (parallelize's default: one per pp rank)."""
    dp = resolved_dp(args.pp, args.dp, args.tp, cp=args.cp)
    if dp is None or (args.microbatches is not None and args.microbatches < 1):
        return  # sizes that do not fit the world: build_mesh says so, naming them
    microbatches = args.microbatches if args.microbatches is not None else args.pp
    problem = batch_split_problem(args.global_batch, dp, microbatches, defaulted=args.microbatches is None)
    if problem:
        p.error(problem)


# The flags that change --config's model shape (model_choice.model_config): refused where a
# config.json gives the shape.
SHAPE_FLAGS = ("n_layers", "dim", "n_heads", "n_kv_heads", "tied", "vocab_size", "n_experts")


def given_shape_flags(args: argparse.Namespace) -> list[str]:
    """The shape flags given, as written on the command line."""
    return ["--" + name.replace("_", "-") for name in SHAPE_FLAGS if getattr(args, name) is not None]


def model_shape_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --config's shape after --dim/--n-heads/--n-kv-heads, or None."""
    from examples.llama.model_choice import model_config

    try:
        model_config(args)
    except ValueError as error:
        return f"--config {args.config} with --dim/--n-heads/--n-kv-heads: {error}"
    return None


def _check_hf_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    problem = hf_model.check_spec(args.hf_model)
    if problem:
        p.error(problem)
    if args.init_from_hf:
        p.error(
            "--hf-model DIR already starts from DIR's weights; --init-from-hf is the LLaMA example's: pass one of them"
        )
    shape_flags = given_shape_flags(args)
    if hf_model.is_directory(args.hf_model) and shape_flags:
        p.error(f"--hf-model DIR takes the model's shape from its config.json; drop {'/'.join(shape_flags)}")
