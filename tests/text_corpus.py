"""Test corpora and tokenizers made on the spot (nothing downloaded): documents from a tiny grammar, a
byte-level BPE `tokenizer.json` trained on them with the `tokenizers` library, and JSONL / Parquet shards."""

from __future__ import annotations

import json
import random
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"

_SUBJECTS = ["the pipeline", "a stage", "the mesh", "every rank", "the optimizer", "one microbatch", "the loader"]
_VERBS = ["sends", "receives", "shards", "reduces", "checkpoints", "evaluates", "schedules"]
_OBJECTS = ["activations", "gradients", "the weights", "a token", "the batch", "its state", "the loss"]


def documents(count: int, seed: int = 0) -> list[str]:
    """`count` short documents of a few sentences each: regular enough that a tiny model learns them in steps."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(rng.randint(2, 6))
        ]
        docs.append(f"document {i}: " + " ".join(sentences).capitalize())
    return docs


def train_bpe(path: Path, texts: list[str], vocab_size: int = 384, special_tokens=(END_OF_TEXT,)) -> Path:
    """A byte-level BPE tokenizer with `special_tokens` (ids 0, 1, ...), trained on `texts`, saved as `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text", row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path
