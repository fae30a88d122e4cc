"""The byte tokenizer as a Hugging Face `tokenizer.json`, so that an export of a byte-level run
holds its tokenizer as any other export does.

The file maps ids exactly as `ByteTokenizer` does (id = UTF-8 byte) for every text, under the
`tokenizers` library, transformers' `AutoTokenizer` and mesh3d's `HFTokenizer`:

- a byte-level pre-tokenizer turns each byte of the text into one of 256 characters (GPT-2's
  alphabet) and a BPE model with no merges gives each character its byte's id;
- byte 0, the end of a document, is the special token "\\x00" (id 0), matched in the text before
  the pre-tokenizer runs. It replaces byte 0's alphabet character ("Ā") in the vocabulary: were
  that character the special token, an "Ā" in a text would encode as the end of a document
  instead of its two bytes.

Written with the standard library alone (a byte-level run needs no `tokenizers`);
`is_byte_tokenizer_file` tells such a file from any other, so that mesh3d's scripts read it back
as the `ByteTokenizer` itself (the same ids, token cache and decoding).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from mesh3d.data.byte_tokenizer import ByteTokenizer

_EOS = "\x00"


def _byte_alphabet() -> list[str]:
    """Byte b's character in GPT-2's byte-level alphabet (printable bytes stand for themselves,
    the others are shifted past 255), as the `tokenizers` ByteLevel pre-tokenizer maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


@cache
def byte_tokenizer_json() -> str:
    """The tokenizer.json text of `ByteTokenizer`: 256 ids, id = byte, "\\x00" (id 0) the special end token."""
    tokenizer = ByteTokenizer()
    alphabet = _byte_alphabet()
    vocab = {(_EOS if b == tokenizer.eos_id else alphabet[b]): b for b in range(tokenizer.vocab_size)}
    plain = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tokenizer.eos_id,
                "content": _EOS,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **plain},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **plain},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    return json.dumps(spec, ensure_ascii=False, indent=1)


def write_byte_tokenizer(directory: str | Path) -> Path:
    """`directory`/tokenizer.json (the byte tokenizer) and a tokenizer_config.json naming its end
    token, so `transformers.AutoTokenizer.from_pretrained(directory)` knows `eos_token`; returns
    the tokenizer.json's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(byte_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": _EOS}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return path


def is_byte_tokenizer_file(path: str | Path) -> bool:
    """Whether `path` (a tokenizer.json, or its directory) is the byte tokenizer's file, as
    `write_byte_tokenizer` writes it (compared as JSON: reformatting keeps it one)."""
    path = Path(path)
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        if path.stat().st_size > 4 * len(byte_tokenizer_json().encode()):  # a real vocabulary: not read whole
            return False
        return json.loads(path.read_text(encoding="utf-8")) == json.loads(byte_tokenizer_json())
    except (OSError, ValueError):
        return False


def open_tokenizer(path: str | Path, eos_token: str | None = None):
    """The tokenizer a tokenizer.json (or its directory) holds: `ByteTokenizer` for the byte
    tokenizer's file (a byte-level run's export trains and generates as the run did), else
    `HFTokenizer(path, eos_token=eos_token)`. A chosen `eos_token` always means `HFTokenizer`: the
    byte tokenizer's end of document is byte 0."""
    if eos_token is None and is_byte_tokenizer_file(path):
        return ByteTokenizer()
    from mesh3d.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(path, eos_token=eos_token)
