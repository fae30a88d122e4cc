"""Where train.py's weights come from (a checkpoint to resume, Hugging Face weights, or the seed),
and its checkpoint saves."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import mesh3d
from examples.llama import hf_model
from examples.llama.fault_injection import FaultInjection
from mesh3d.data import DistributedLoader
from mesh3d.train import resume_from, resume_latest


def restore(args, pm, optimizer, loader: DistributedLoader, say: Callable[[str], None]) -> tuple[int, str, bool]:
    """Resume (weights, optimizer state, RNG and the data position, saved under any layout) or import
    Hugging Face weights, as the flags say: (the first step, where the weights came from, resumed)."""
    start_step, origin, state = 0, f"initialized with seed {args.seed}", None
    if args.resume_from:
        resumed, state = args.resume_from, resume_from(args.resume_from, pm, optimizer)
    elif args.resume:
        resumed, state = resume_latest(args.checkpoint_dir, pm, optimizer, say=say)
    if state is not None:
        loader.load_state_dict(state["data_state"])
        start_step, origin = state["step"], f"resumed from {resumed} (step {state['step']})"
    elif args.init_from_hf or hf_model.weights_dir(args):
        weights = args.init_from_hf or hf_model.weights_dir(args)
        try:
            mesh3d.checkpoint.import_safetensors(pm, weights)
        except ValueError as error:
            if args.init_from_hf:  # the LLaMA example's import: another architecture has its own way in
                error.add_note(f"to train the model in {weights} as its own architecture, pass --hf-model {weights}")
            raise
        origin = f"weights from {weights}"
    return start_step, origin, state is not None


def save_checkpoint(pm, optimizer, loader, step: int, args, is_main: bool, fault: FaultInjection | None) -> None:
    """A checkpoint of step `step` under --checkpoint-dir, keeping the last --keep-last."""
    began = time.perf_counter()
    path = mesh3d.checkpoint.save(
        Path(args.checkpoint_dir) / f"step{step}",
        pm,
        optimizer,
        step=step,
        data_state=loader.state_dict(),
        extra={"args": vars(args)},
        keep_last=args.keep_last,
        before_publish=fault.before_publish if fault else None,
    )
    if is_main:
        print(f"saved checkpoint {path} in {time.perf_counter() - began:.2f} s", flush=True)
