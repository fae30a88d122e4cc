"""What train.py says of each step: its metrics row and progress line, and the inputs each batch
brings besides its tokens."""

from __future__ import annotations

from mesh3d.data.documents import document_ids
from mesh3d.train import MemoryPeak, Progress


def step_record(step, loss, lr, grad_norm, seconds, progress, args, restart, stepped, peak, prediction) -> dict:
    """A step's metrics row (the JSONL line, TensorBoard's and W&B's scalars): what it did, its
    speed, its memory peak, and on the first step of a run the planner's prediction, where made."""
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
        **peak.as_record(),
        **(prediction.as_record() if prediction else {}),
    }


def router_terms(terms: dict) -> dict:
    """A mixture of experts' loss terms (the loss is their sum): the cross-entropy and the router's."""
    if "router_aux" not in terms:
        return {}
    return {"cross_entropy": terms["loss_fn"], "router_aux": terms["router_aux"]}


def step_line(progress: Progress, record: dict, seconds: float, peak: MemoryPeak) -> str:
    """The progress line of a step's metrics `record`: loss, lr, time, memory, and where there are
    they, the router loss's share, the held-out loss and a skipped update."""
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
        + f"  {peak.describe()}"
        + router
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
