"""train.py's data: which tokenizer, which corpus, and the held-out split for evaluation.

- `--tokenizer PATH` (a Hugging Face tokenizer.json, or its directory); with `--init-from-hf DIR`
  and no `--tokenizer`, DIR/tokenizer.json when there is one; else the byte tokenizer.
- `--data` files, directories and globs of .txt/.jsonl/.parquet, tokenized once into the cache;
  `--token-file` a pre-tokenized array; neither: the standard library's sources.
- `--eval-every N` holds out `--eval-batches` global batches of samples, drawn by `--seed`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mesh3d.data import ByteTokenizer, HFTokenizer, SampleSubset, TokenDataset, split_heldout, stdlib_sources


def build_tokenizer(args: argparse.Namespace):
    """The run's tokenizer: --tokenizer, else the --init-from-hf directory's tokenizer.json, else bytes."""
    if args.tokenizer:
        return HFTokenizer(args.tokenizer)
    if args.init_from_hf and (Path(args.init_from_hf) / "tokenizer.json").is_file():
        return HFTokenizer(Path(args.init_from_hf) / "tokenizer.json")
    return ByteTokenizer()


def check_vocab(tokenizer, vocab_size: int, model_name: str) -> None:
    """The model must have an embedding row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        described = getattr(tokenizer, "path", "the byte tokenizer")
        raise SystemExit(
            f"the tokenizer ({described}) has vocab_size={tokenizer.vocab_size}, more than the model {model_name}'s "
            f"vocab_size={vocab_size}; pass --vocab-size {tokenizer.vocab_size} (or more), or a tokenizer that fits"
        )


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple[TokenDataset | SampleSubset, SampleSubset | None]:
    """(training samples, held-out samples or None): the whole corpus trains when nothing is evaluated."""
    if args.token_file:
        dataset = TokenDataset.from_token_file(args.token_file, args.seq_len, dtype=args.token_dtype)
    else:
        paths = args.data if args.data else stdlib_sources()
        dataset = TokenDataset.from_corpus(paths, args.seq_len, tokenizer, text_field=args.text_field,
                                           workers=args.tokenize_workers, progress=True)
    if not args.eval_every:
        return dataset, None
    return split_heldout(dataset, args.eval_batches * args.global_batch, args.seed)
