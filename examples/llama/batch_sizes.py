"""The sizes train.py's batches must have, checked with the other flags and said in flags.

A step's global batch is split over the data-parallel ranks, then each rank's share into
microbatches (the ranks of a cp group share their dp rank's rows, each sequence cut into 2 x cp
chunks); a corpus must hold at least one global batch (and the held-out ones). Found only in
`pm.step` or the loader, these would stop every rank with a traceback naming library parameters;
found here, rank 0 says once which flag to change and to what.
"""

from __future__ import annotations

import os


def resolved_dp(pp: int, dp: int, tp: int, world_size: int | None = None, cp: int = 1) -> int | None:
    """--dp as build_mesh will resolve it (-1: the rest of the world, pp x cp x tp taken out);
    None where the sizes do not fit the world (build_mesh then says so)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    others = pp * cp * tp
    if pp < 1 or cp < 1 or tp < 1 or world % others:
        return None
    dp = world // others if dp == -1 else dp
    return dp if dp >= 1 and dp * others == world else None


def seq_len_problem(seq_len: int, cp: int) -> str | None:
    """Why --seq-len does not cut into 2 x --cp chunks (a head and a tail chunk of every sequence per
    cp rank); None if it does, or if --cp is not >= 1 (build_mesh then says so)."""
    chunks = 2 * cp
    if cp <= 1 or (seq_len >= 1 and seq_len % chunks == 0):
        return None
    lower, upper = (seq_len // chunks) * chunks, (seq_len // chunks + 1) * chunks
    choices = f"--seq-len {lower} or {upper}" if lower >= 1 else f"--seq-len {upper}"
    return (
        f"--seq-len {seq_len} is not divisible by 2 x --cp {cp} = {chunks} (each cp rank takes a chunk from the "
        f"head and one from the tail of every sequence); use {choices}, or another --cp"
    )


def batch_split_problem(global_batch: int, dp: int, microbatches: int, defaulted: bool = False) -> str | None:
    """Why --global-batch does not split over --dp ranks and then into --microbatches; None if it does.

    defaulted: --microbatches was not given (it is --pp's value), said so in the message.
    """
    quantum = dp * microbatches
    if global_batch >= 1 and global_batch % quantum == 0:
        return None
    lower, upper = (global_batch // quantum) * quantum, (global_batch // quantum + 1) * quantum
    choices = f"--global-batch {lower} or {upper}" if lower >= 1 else f"--global-batch {upper}"
    mb_flag = f"--microbatches {microbatches}" + (" (the default: --pp)" if defaulted else "")
    multiple = f"a multiple of --dp {dp} x --microbatches {microbatches} = {quantum}"
    if global_batch < 1:
        return f"--global-batch {global_batch} must be >= 1; use {choices} ({multiple})"
    if global_batch % dp:
        return f"--global-batch {global_batch} does not split over --dp {dp}; use {choices} ({multiple})"
    per_rank = global_batch // dp
    return (
        f"--global-batch {global_batch} over --dp {dp} gives {per_rank} samples per rank, which {mb_flag} "
        f"does not divide; use {choices} ({multiple}), or a --microbatches that divides {per_rank}"
    )


def corpus_problem(samples: int, tokens: int, seq_len: int, global_batch: int, held_out_batches: int) -> str | None:
    """Why the corpus cannot give one training batch after the held-out ones; None if it can.

    samples: sequences of seq_len the corpus gives; held_out_batches: global batches kept for
    evaluation (0 without --eval-every).
    """
    needed = (1 + held_out_batches) * global_batch
    if samples >= needed:
        return None
    held = f" plus --eval-batches {held_out_batches} held out" if held_out_batches else ""
    longest = (tokens - 1) // needed  # the --seq-len at which the corpus gives `needed` samples
    fixes = [f"--global-batch {samples // (1 + held_out_batches)} or less"] if samples >= 1 + held_out_batches else []
    if held_out_batches:
        fixes.append(f"--eval-batches {samples // global_batch - 1} or less" if samples >= 2 * global_batch else "")
    fixes.append(f"--seq-len {longest} or less" if longest >= 1 else "")
    fixes.append("more --data")
    return (
        f"the corpus gives {samples} samples of --seq-len {seq_len} ({tokens} tokens), fewer than the {needed} "
        f"needed for one --global-batch {global_batch}{held}; pass {', '.join(f for f in fixes if f)}"
    )
