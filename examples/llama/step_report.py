"""What train.py says of the run before its first step, of each step its metrics row and progress
line, and the inputs each batch brings besides its tokens."""

from __future__ import annotations

from examples.llama import arguments
from examples.llama.run_config import effective_config_toml
from mesh3d.data.documents import document_ids
from mesh3d.planner import MemoryPrediction
from mesh3d.train import MemoryPeak, Progress, human_count, imbalance_column


def run_summary(args, layout, pm, model: str, n_params: int, origin: str, tokenizer, dataset, heldout, loader) -> str:
    """The settings that differ from the defaults, the layout and its stages, the model, tokenizer and data."""
    return (
        f"effective config (TOML, the settings that differ from the defaults):\n"
        f"{effective_config_toml(args, arguments.parse_args([])) or '(none)'}\n{layout}\n{pm}\n"
        f"model {model}: {n_params / 1e6:.2f}M parameters, {origin}\n"
        f"tokenizer: {'pre-tokenized' if args.token_file else repr(tokenizer)}\n"
        f"data: {human_count(len(dataset.tokens))} tokens ({len(dataset)} samples of {args.seq_len} "
        f"to train on{f', {len(heldout)} held out' if heldout else ''}), "
        f"global batch {args.global_batch} = dp {layout.dp} x {loader.local_batch_size}"
        + (f", each sequence cut over cp {layout.cp} ranks" if layout.cp > 1 else "")
    )


def step_record(step, loss, lr, grad_norm, seconds, progress, args, restart, stepped, peak, prediction) -> dict:
    """A step's metrics row (the JSONL line, TensorBoard's and W&B's scalars): what it did, its
    speed, its memory (logging steps only: `peak` None elsewhere; every rank's rise), and on the
    first step of a run the planner's prediction, where made (the fullest rank's and every rank's)."""
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": progress.tokens_per_step / seconds,
        "elapsed_s": progress.elapsed(),
        "param_dtype": args.param_dtype,
        "compile": args.compile,
        "restart": restart,
        "skipped": not stepped,
        "tokens": step * progress.tokens_per_step,
        **(peak.as_record() if peak is not None else {}),
        **(prediction.as_record(peak) if prediction else {}),
    }


def router_terms(terms: dict) -> dict:
    """A mixture of experts' loss terms (the loss is their sum): the cross-entropy and the router's."""
    if "router_aux" not in terms:
        return {}
    return {"cross_entropy": terms["loss_fn"], "router_aux": terms["router_aux"]}


def step_line(
    progress: Progress, record: dict, seconds: float, peak: MemoryPeak, prediction: MemoryPrediction | None
) -> str:
    """The progress line of a step's metrics `record`: loss, lr, time, memory (the largest rise over the
    ranks, beside the planner's figure for that rank where `prediction` was made), and where there are
    they, the router loss's share, the experts' imbalance, the held-out loss and a skipped update."""
    evaluated = (
        f"  eval_loss {record['eval_loss']:.4f}  eval_ppl {record['eval_perplexity']:.2f}"
        if "eval_loss" in record
        else ""
    )
    router = (
        f"  (ce {record['cross_entropy']:.4f} + router {record['router_aux']:.4f})" if "router_aux" in record else ""
    )
    return (
        progress.line(record["step"], record["loss"], record["lr"], record["grad_norm"], seconds)
        + f"  {peak.describe(prediction.planned_for(peak) if prediction else None)}"
        + router
        + imbalance_column(record)
        + evaluated
        + ("  SKIPPED (non-finite gradient norm)" if record["skipped"] else "")
    )


def per_sample_inputs(args, tokenizer):
    """The inputs each batch brings besides its tokens: with --document-mask, each token's document
    (from the end-of-document tokens in it: nothing to keep across a resume, the data position is
    the tokens' own)."""
    if not args.document_mask:
        return lambda inputs: {}
    return lambda inputs: {"document_ids": document_ids(inputs, tokenizer.separator_id)}
