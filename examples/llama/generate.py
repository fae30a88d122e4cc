"""See what a trained model writes: text from a mesh3d checkpoint (any layout) or a Hugging Face export.

    python examples/llama/generate.py --checkpoint ckpt/step100 --prompt "def " --max-new-tokens 64 --top-p 0.9
    python examples/llama/generate.py --checkpoint ckpt --greedy            # the newest checkpoint in ckpt/
    python examples/llama/generate.py --checkpoint runs/hf --prompt "import " --num-samples 3 --seed 1

--checkpoint takes what train.py wrote: a --checkpoint-dir checkpoint (or the directory of them)
or an --export-hf directory. The tokenizer is the one the model was trained with, as train.py
picks it (--tokenizer, else the Hugging Face directory's tokenizer.json, else bytes); --tokenizer
overrides it. Each prompt starts a new document: the tokenizer's document separator goes in front
of it (--raw-prompt leaves it out), and generation stops when the model ends the document.
Sampling is greedy (--greedy or --temperature 0) or from the distribution at --temperature,
restricted to --top-k tokens and/or the --top-p nucleus, seeded by --seed. A KV cache makes each
new token cost one position.

From Python:

    from examples.llama.generate import generate
    new_ids = generate(model, prompt_ids, max_new_tokens=64, sampling=Sampling(temperature=0.8, top_p=0.9))
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the example imports itself as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.llama.kv_cache import KVCache  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402
from examples.llama.sampling import Sampling, sample  # noqa: E402
from examples.llama.trained_model import TrainedSource  # noqa: E402
from mesh3d.data import ByteTokenizer, open_tokenizer  # noqa: E402


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt: torch.Tensor | list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    seed: int = 0,
    stop_id: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """New token ids after `prompt` (ids, (seq,) or (batch, seq)): shape (batch, n), n <= max_new_tokens.

    `model`: the LLaMA example's Transformer, or a transformers causal LM (TrainedSource.load gives either).

    The prompt is run once into a KV cache, then each new token at one position. `stop_id`: a row
    that produced it produces only it from then on, and generation ends once every row has.
    `vocab_size`: only ids below it are chosen (a tokenizer smaller than the model's padded
    vocabulary). The same seed gives the same tokens.
    """
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)
    prompt = prompt[None] if prompt.ndim == 1 else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"generate: prompt must be a non-empty (seq,) or (batch, seq) of ids, got shape {tuple(prompt.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    length = prompt.shape[1] + max_new_tokens
    if isinstance(model, Transformer) and length > model.args.max_seq_len:
        raise ValueError(
            f"generate: the prompt ({prompt.shape[1]} tokens) and max_new_tokens={max_new_tokens} need {length} "
            f"positions, more than the model's max_seq_len={model.args.max_seq_len}; "
            f"load it with max_seq_len >= {length} "
            "(TrainedSource.load(max_seq_len=...)) or ask for fewer tokens"
        )
    model.eval()
    next_logits = _cached_forward(model, prompt.shape[0], length)
    generator = torch.Generator(device=device).manual_seed(seed)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    logits = next_logits(prompt)
    new = []
    for _ in range(max_new_tokens):
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")  # padding rows: never a token
        token = sample(logits, sampling, generator)
        if stop_id is not None:
            token = token.masked_fill(done, stop_id)
            done |= token == stop_id
        new.append(token)
        if len(new) == max_new_tokens or bool(done.all()):
            break
        logits = next_logits(token[:, None])
    return torch.stack(new, dim=1)


def _cached_forward(model: torch.nn.Module, batch: int, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids (batch, n) -> the last position's logits, each call after the ones before it (a KV cache):
    the example's own cache for its Transformer, transformers' DynamicCache for a transformers model."""
    if not isinstance(model, Transformer):
        from transformers import DynamicCache

        cache = DynamicCache()
        # transformers renames past_key_values to cache (5.x deprecates the old name): whichever forward takes
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        return lambda ids: model(input_ids=ids, use_cache=True, **{name: cache}).logits[:, -1].float()
    parameter = next(model.parameters())
    cache = KVCache(model.args, batch, length, device=parameter.device, dtype=parameter.dtype)
    return lambda ids: model(ids, cache=cache)[:, -1]


def pick_tokenizer(path: str | None, source: TrainedSource, eos_token: str | None = None):
    """--tokenizer, else the one the model was trained with (a tokenizer.json), else bytes; its
    end-of-document token from --eos-token, else the one training was given, else its own."""
    eos_token = eos_token or source.eos_token
    if path:
        return open_tokenizer(path, eos_token=eos_token)
    if source.tokenizer_path is not None:
        if not source.tokenizer_path.exists():
            raise SystemExit(
                f"{source.description} was trained with the tokenizer {source.tokenizer_path}, which is not there; "
                "pass --tokenizer PATH"
            )
        return open_tokenizer(source.tokenizer_path, eos_token=eos_token)  # a byte-level run's: ByteTokenizer
    return ByteTokenizer()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a mesh3d checkpoint (any layout), a directory of them (the newest), or a Hugging Face directory",
    )
    p.add_argument(
        "--prompt", action="append", default=None, help="text to continue (repeat for several; default: empty)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy; below 1 sharper, above 1 flatter")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens that sum to p only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="a tokenizer.json (default: the model's own, else bytes)"
    )
    p.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="the token that ends each document (default: train.py's --eos-token, else the tokenizer's own)",
    )
    p.add_argument("--raw-prompt", action="store_true", help="do not put the document separator before the prompt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        p.error("--max-new-tokens and --num-samples must be >= 1")
    if not args.temperature >= 0:
        p.error(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    args.sampling = Sampling(0.0 if args.greedy else args.temperature, args.top_k, args.top_p)
    return args


def main(argv=None) -> list[str]:
    """Print (and return) each prompt's continuations."""
    args = parse_args(argv)
    try:
        source = TrainedSource.open(args.checkpoint)
    except (ValueError, FileNotFoundError) as error:  # what the directory is not, said without a traceback
        raise SystemExit(f"error: {error}") from None
    tokenizer = pick_tokenizer(args.tokenizer, source, args.eos_token)
    if tokenizer.vocab_size > source.vocab_size:
        raise SystemExit(
            f"the tokenizer {tokenizer!r} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
            f"({source.vocab_size}); pass the --tokenizer it was trained with"
        )
    start = [] if args.raw_prompt else [tokenizer.separator_id]
    prompts = args.prompt or [""]
    encoded = [start + [int(i) for i in tokenizer.encode(text)] for text in prompts]
    if not all(encoded):
        raise SystemExit("--raw-prompt needs a non-empty --prompt: the model must be given at least one token")
    needed = max(len(ids) for ids in encoded) + args.max_new_tokens
    model = source.load(args.device, max_seq_len=needed)
    print(f"{source.description}, tokenizer {tokenizer!r}", flush=True)
    if needed > source.max_seq_len:
        print(f"note: {needed} positions, beyond the {source.max_seq_len} it was trained on", flush=True)
    texts = []
    for text, ids in zip(prompts, encoded):
        rows = torch.tensor([ids] * args.num_samples)
        new = generate(
            model,
            rows,
            args.max_new_tokens,
            args.sampling,
            seed=args.seed,
            stop_id=tokenizer.separator_id,
            vocab_size=tokenizer.vocab_size,
        )
        for row in new.tolist():
            if tokenizer.separator_id in row:
                row = row[: row.index(tokenizer.separator_id)]
            texts.append(tokenizer.decode(ids[len(start) :] + row))  # whole: a BPE piece may join the two
            print(f"--- {text!r}\n{texts[-1]}", flush=True)
    return texts


if __name__ == "__main__":
    main()
