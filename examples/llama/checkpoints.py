"""Where train.py's weights come from (a checkpoint to resume, Hugging Face weights, or the seed),
its checkpoint saves, and its Hugging Face export."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mesh3d
from examples.llama import hf_model
from examples.llama.fault_injection import FaultInjection
from examples.llama.optimization import schedule_length, schedule_warning
from examples.llama.run_config import args_as_record
from examples.llama.text_data import tokenizer_file
from mesh3d.checkpoint.train_state import read_train_state
from mesh3d.data import DistributedLoader, write_byte_tokenizer
from mesh3d.train import resume_from, resume_latest
from mesh3d.train.resume import checkpoints_newest_first

# The settings a checkpoint's data position belongs to: another value is another sample order, which
# the loader refuses (mesh3d.data.DistributedLoader.load_state_dict), but only once the model is built.
# Paths (--data, --tokenizer) are not among them: a corpus moved is the same data; the loader counts
# the samples of whatever they name.
DATA_SETTINGS = ("seq_len", "seed", "text_field")


def refuse_other_data(args) -> None:
    """Before the model is built: refuse a resume whose data settings differ from those its
    checkpoint was saved with (its extra.args). Every rank reads the same checkpoint (rank 0's
    listing) and raises the same error; a checkpoint without saved settings is left to the loader."""
    if args.resume_from:
        chosen = [args.resume_from]
    elif args.resume and args.checkpoint_dir:
        chosen = checkpoints_newest_first(args.checkpoint_dir)[:1]
    else:
        return
    try:
        saved = read_train_state(Path(chosen[0]))["extra"]["args"]
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return  # none yet, or a state resume itself will name as missing or damaged
    differ = [key for key in DATA_SETTINGS if key in saved and saved[key] != getattr(args, key)]
    if differ:
        flags = ", ".join(f"--{key.replace('_', '-')} {getattr(args, key)!r} (saved: {saved[key]!r})" for key in differ)
        raise ValueError(
            f"resuming from {chosen[0]}: its data position belongs to other data settings: {flags}; "
            "pass the saved values to continue that run, or start a new one in another --checkpoint-dir"
        )


def restore(args, pm, optimizer, loader: DistributedLoader, say: Callable[[str], None]) -> tuple[int, str, bool]:
    """Resume (weights, optimizer state, RNG and the data position, saved under any layout) or import
    Hugging Face weights, as the flags say: (the first step, where the weights came from, resumed)."""
    start_step, origin, state = 0, f"initialized with seed {args.seed}", None
    if args.resume_from:
        resumed, state = args.resume_from, resume_from(args.resume_from, pm, optimizer)
    elif args.resume:
        resumed, state = resume_latest(args.checkpoint_dir, pm, optimizer, say=say)
    if args.resume and state is None:  # as torchtitan does: the same command starts a job and resumes it
        say(f"--resume: no checkpoint that loads in {args.checkpoint_dir}; training from scratch")
    if state is not None:
        loader.load_state_dict(state["data_state"])
        start_step, origin = state["step"], f"resumed from {resumed} (step {state['step']})"
    # Saved with the checkpoint (extra.args), so a later resume keeps it.
    args.lr_schedule_steps, note = schedule_length(args, _saved_args(state), start_step)
    if note:
        say(note)
    warning = schedule_warning(args)  # --steps within --warmup: the lr never decays
    if warning:
        say(warning)
    if state is None and (args.init_from_hf or hf_model.weights_dir(args)):
        weights = args.init_from_hf or hf_model.weights_dir(args)
        try:
            mesh3d.checkpoint.import_safetensors(pm, weights)
        except ValueError as error:
            if args.init_from_hf:  # the LLaMA example's import: another architecture has its own way in
                error.add_note(f"to train the model in {weights} as its own architecture, pass --hf-model {weights}")
            raise
        origin = f"weights from {weights}"
    return start_step, origin, state is not None


def nothing_to_train(at_step: int, args) -> str:
    """What a resumed run at or past --steps says: nothing trains, and how to go on."""
    where = (
        f"already at step {at_step} of --steps {args.steps}"
        if at_step == args.steps
        else (f"the checkpoint is at step {at_step}, past --steps {args.steps}")
    )
    return (
        f"{where}: nothing to train. To go on, pass --steps M > {at_step} (the LR schedule keeps its "
        f"{args.lr_schedule_steps} steps, the lr staying at its final value past them, unless --lr-schedule-steps M)"
    )


def _saved_args(state: dict | None) -> dict | None:
    """The training arguments a resumed checkpoint keeps ({} for one saved without them); None: not resumed."""
    if state is None:
        return None
    saved = (state.get("extra") or {}).get("args")
    return saved if isinstance(saved, dict) else {}


@dataclass
class Pending:
    """A checkpoint being written in the background (--async-checkpoint), and when its save began."""

    handle: mesh3d.checkpoint.AsyncSave
    began: float


def save_checkpoint(
    pm, optimizer, loader, step: int, args, is_main: bool, fault: FaultInjection | None, pending: Pending | None = None
) -> Pending | None:
    """A checkpoint of step `step` under --checkpoint-dir, keeping the last --keep-last. With
    --async-checkpoint it is written in the background: `pending` (the previous one's handle) is
    waited for first, and the new one's handle returned for `finish_checkpoint`."""
    finish_checkpoint(pending, is_main)
    target = Path(args.checkpoint_dir) / f"step{step}"
    if is_main and target.exists():  # a run resumed from before it: said, since it cannot be had back
        print(f"replacing checkpoint {target}, which an earlier run saved at the same step", flush=True)
    began = time.perf_counter()
    save = mesh3d.checkpoint.async_save if args.async_checkpoint else mesh3d.checkpoint.save
    saved = save(
        target,
        pm,
        optimizer,
        step=step,
        data_state=loader.state_dict(),
        extra={"args": args_as_record(args)},
        keep_last=args.keep_last,
        before_publish=fault.before_publish(step) if fault else None,
    )
    took = time.perf_counter() - began
    if not args.async_checkpoint:
        if is_main:
            print(f"saved checkpoint {saved} in {took:.2f} s", flush=True)
        return None
    if is_main:
        print(f"saving checkpoint {saved.path} in the background (training paused {took:.2f} s)", flush=True)
    return Pending(saved, began)


def finish_checkpoint(pending: Pending | None, is_main: bool) -> None:
    """Wait for a checkpoint written in the background to be published (its failure raised)."""
    if pending is None:
        return
    waited = time.perf_counter()
    path = pending.handle.wait()
    if is_main:
        now = time.perf_counter()
        print(
            f"saved checkpoint {path} in {now - pending.began:.2f} s in the background "
            f"(training waited {now - waited:.2f} s for it)",
            flush=True,
        )


def export_hf(pm, args, is_main: bool) -> None:
    """--export-hf: the model as Hugging Face safetensors and config.json (its eos_token_id the token
    that ended each training document), with the run's tokenizer.json beside them, so that
    generate.py and transformers read the directory alone. A byte-level run's is the byte
    tokenizer's file (mesh3d.data.write_byte_tokenizer: the same ids); a --token-file run has none."""
    out = Path(args.export_hf)
    mesh3d.checkpoint.export_safetensors(pm, out)
    if not is_main:
        return
    tokenizer = None if args.token_file else tokenizer_file(args)
    if tokenizer is not None and (out / "tokenizer.json").resolve() != tokenizer.resolve():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    elif tokenizer is None and not args.token_file:
        write_byte_tokenizer(out)
    print(f"exported Hugging Face safetensors to {out}", flush=True)
