"""train.py's data: which tokenizer, which corpus, the model's vocabulary, and the held-out split for evaluation.

- `--tokenizer PATH` (a Hugging Face tokenizer.json, or its directory); with `--init-from-hf DIR`
  or `--hf-model DIR` and no `--tokenizer`, DIR/tokenizer.json when there is one; else the byte tokenizer.
  `--eos-token TOKEN` chooses the token that ends each document where the tokenizer declares none.
- The model's vocabulary: `--vocab-size N` when given (at least the tokenizer's), the
  `--init-from-hf` (or `--hf-model DIR`) model's own, else the tokenizer's padded to a multiple
  that tensor parallelism divides (`padded_vocab_size`); the padding rows are never an input or a target.
- `--data` files, directories and globs of .txt/.jsonl/.parquet, tokenized once into the cache;
  `--token-file` a pre-tokenized array; neither: the standard library's sources.
- `--eval-every N` holds out `--eval-batches` global batches of samples, drawn by `--seed`.
- A `--token-file`'s ids are checked against the model's vocabulary when the file is opened,
  before the model is parallelized (the step's batch check would find one only when its batch comes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from examples.llama.batch_sizes import corpus_problem
from examples.llama.config import ModelArgs, padded_vocab_size
from examples.llama.hf_model import hf_model_dir
from mesh3d.data import (
    ByteTokenizer,
    SampleSubset,
    TokenDataset,
    load_token_file,
    open_tokenizer,
    split_heldout,
    stdlib_sources,
)
from mesh3d.data.hf_tokenizer import NoEOSTokenError

# Ids read at a time when a --token-file is checked: a bounded copy of a memory-mapped file.
_CHUNK = 1 << 24

# The library's parameters as this script's flags, for the library's errors.
_FLAGS = "train.py sets the data's `paths` with --data and `text_field` with --text-field"


def tokenizer_file(args: argparse.Namespace) -> Path | None:
    """The run's tokenizer.json: --tokenizer, else the --init-from-hf (--hf-model) directory's; None: bytes."""
    model_dir = args.init_from_hf or hf_model_dir(args)
    if args.tokenizer:
        given = Path(args.tokenizer)
        return given / "tokenizer.json" if given.is_dir() else given
    if model_dir and (Path(model_dir) / "tokenizer.json").is_file():
        return Path(model_dir) / "tokenizer.json"
    return None


def build_tokenizer(args: argparse.Namespace):
    """The run's tokenizer: --tokenizer, else the --init-from-hf directory's tokenizer.json, else bytes."""
    path = tokenizer_file(args)
    if path is None:
        if args.eos_token is not None:
            raise SystemExit(
                f"--eos-token {args.eos_token} needs a Hugging Face tokenizer (--tokenizer); "
                f"the byte tokenizer ends each document with byte 0"
            )
        return ByteTokenizer()
    try:
        return open_tokenizer(path, eos_token=args.eos_token)  # a byte-level run's export: the ByteTokenizer
    except NoEOSTokenError as e:
        raise SystemExit(e.explain("--eos-token TOKEN")) from None


def fit_vocab(config: ModelArgs, tokenizer, args: argparse.Namespace) -> ModelArgs:
    """`config` with an embedding row for every id the tokenizer makes.

    Without --vocab-size (and --init-from-hf) the vocabulary is the tokenizer's, padded by
    `padded_vocab_size` for --tp; otherwise the given size, refused when smaller than the
    tokenizer's. The model then declares the tokenizer's size, so the batch check refuses ids in
    the padding rows. A pre-tokenized --token-file has no tokenizer: the config's size stands.
    """
    if args.token_file:
        return config
    tokens = tokenizer.vocab_size
    described = getattr(tokenizer, "path", "the byte tokenizer")
    if args.init_from_hf:
        check_fits(config.vocab_size, args.init_from_hf, tokenizer, args)
    elif args.vocab_size is not None:
        if tokens > args.vocab_size:
            raise SystemExit(
                f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokens} tokens "
                f"({described}): pass --vocab-size {tokens} or more, or leave it out to take the "
                f"tokenizer's ({padded_vocab_size(tokens, args.tp)} with padding)"
            )
    else:
        config = config.with_(vocab_size=padded_vocab_size(tokens, args.tp))
    return config.with_(tokenizer_vocab_size=tokens, eos_token_id=tokenizer.separator_id)


def check_fits(vocab_size: int, model_dir: str, tokenizer, args: argparse.Namespace) -> None:
    """A model whose vocabulary its directory fixes (--init-from-hf, --hf-model DIR) must have a row
    for every id the tokenizer makes."""
    if args.token_file:
        return
    tokens = tokenizer.vocab_size
    if tokens > vocab_size:
        described = getattr(tokenizer, "path", "the byte tokenizer")
        raise SystemExit(
            f"the tokenizer ({described}) has {tokens} tokens, more than the vocab_size="
            f"{vocab_size} of the model in {model_dir}; use the model's own tokenizer"
        )


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple[TokenDataset | SampleSubset, SampleSubset | None]:
    """(training samples, held-out samples or None): the whole corpus trains when nothing is evaluated."""
    if args.token_file:
        dataset = TokenDataset.from_token_file(args.token_file, args.seq_len, dtype=args.token_dtype)
    else:
        paths = args.data if args.data else stdlib_sources()
        try:
            dataset = TokenDataset.from_corpus(
                paths, args.seq_len, tokenizer, text_field=args.text_field, workers=args.tokenize_workers, progress=True
            )
        except (ValueError, FileNotFoundError) as e:
            e.add_note(_FLAGS)  # the library's errors name its parameters
            raise
    held_out = args.eval_batches if args.eval_every else 0
    problem = corpus_problem(len(dataset), len(dataset.tokens), args.seq_len, args.global_batch, held_out)
    if problem:
        raise SystemExit(problem)
    if not args.eval_every:
        return dataset, None
    return split_heldout(dataset, args.eval_batches * args.global_batch, args.seed)


def refuse_bad_token_ids(args: argparse.Namespace, model) -> None:
    """A --token-file's first id outside [0, the model's vocab_size), refused by every rank alike
    (each reads the file) with its place in the file; nothing without a --token-file (a tokenizer's
    ids fit the vocabulary by construction, fit_vocab) or a model that declares no vocabulary."""
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not args.token_file or not isinstance(vocab, int):
        return
    tokens = load_token_file(args.token_file, args.token_dtype)
    for start in range(0, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start : start + _CHUNK]).astype(np.int64)
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab))
        if bad.size:
            where = start + int(bad[0])
            raise SystemExit(
                f"--token-file {args.token_file}: token id {int(chunk[bad[0]])} at index {where} (of {len(tokens)}) "
                f"is outside [0, {vocab}): the model's vocab_size is {vocab}; pass the --config (or --vocab-size) "
                "the file was tokenized for, or re-tokenize it"
            )
