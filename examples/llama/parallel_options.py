"""What train.py hands `mesh3d.parallelize`, from its flags: one source for the run itself, the
planner's memory prediction beside it and the dry run (dry_run.py)."""

from __future__ import annotations

import argparse
import functools

from examples.llama import arguments
from examples.llama.model import llama_tp_plan
from examples.llama.optimization import build_optimizer


def planned_choices(args: argparse.Namespace) -> dict:
    """The keywords the planner predicts a layout's memory with (mesh3d.planner.predict_memory)."""
    return dict(
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        layers_per_stage=args.layers_per_stage,
        activation_checkpoint=args.activation_checkpoint,
        dp_mode=args.dp_mode,
        param_dtype=arguments.PARAM_DTYPES[args.param_dtype],
        compile=args.compile,
        fused_loss=args.fused_loss,
    )


def parallelize_options(args: argparse.Namespace) -> dict:
    """Every keyword of parallelize but the model and the layout."""
    # A never-drain schedule updates inside pm.step, so parallelize builds the optimizer (pm.optimizer).
    inside = functools.partial(build_optimizer, args=args) if arguments.never_drains(args.schedule) else None
    return dict(
        **planned_choices(args),
        dp_shard=args.dp_shard,
        # A Hugging Face model's plan is its own (its config's base_model_tp_plan)
        tp_plan=None if args.hf_model else llama_tp_plan(loss_parallel=args.loss_parallel),
        loss_parallel=args.loss_parallel,
        float8=args.float8,
        seed=args.seed,
        optimizer=inside,
    )
