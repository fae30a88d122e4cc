"""A Hugging Face `tokenizer.json`, read with the `tokenizers` library (the optional extra `mesh3d[text]`).

It offers what the token cache needs of any tokenizer, as `ByteTokenizer` does: a `name` that
changes whenever the ids would (it hashes the file and the chosen separator), `vocab_size`, the
id that separates documents, the narrowest numpy `dtype` that holds every id, and `encode_batch`.

Documents are separated by an end-of-sequence token: the one chosen with `eos_token`, else the
one the tokenizer declares; a tokenizer that declares only a beginning-of-sequence token (as some
Llama tokenizers do) gets that token in front of every document instead. A tokenizer that declares
neither but has exactly one special token uses that one. Otherwise `NoEOSTokenError` lists the
tokenizer's special tokens to choose from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

# Where no tokenizer_config.json or post-processor names them: the special tokens of common
# tokenizer families, in the order they are preferred.
_KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_KNOWN_BOS = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[CLS]")


class NoEOSTokenError(ValueError):
    """No token to separate documents: the tokenizer declares none and none was chosen, or the
    chosen one (`chosen`) is not in its vocabulary.

    `special_tokens` are the tokenizer's own special tokens (one of them usually ends a text);
    `explain(choice)` words the message for whoever chooses: the library's `eos_token=TOKEN` by
    default, a training script's flag where it has one.
    """

    def __init__(self, path: str, special_tokens: list[str], chosen: str | None = None):
        super().__init__(path, special_tokens, chosen)  # the constructor's arguments: it pickles across processes
        self.path, self.special_tokens, self.chosen = path, special_tokens, chosen

    def explain(self, choice: str = "HFTokenizer(path, eos_token=TOKEN)") -> str:
        """The error's message, telling the user to choose the token with `choice`."""
        if self.chosen is not None:
            what = f"the end-of-sequence token {self.chosen!r} is not in the vocabulary of {self.path}"
        else:
            what = f"{self.path} declares no end-of-sequence (or beginning-of-sequence) token to separate documents"
        if self.special_tokens:
            how = f"its special tokens are {self.special_tokens}: choose the one that ends a document with {choice}"
        else:
            how = (
                f"it has no special tokens: choose a token of its vocabulary with {choice}, or add a special "
                f"token such as {_KNOWN_EOS[1]!r} to the tokenizer"
            )
        return f'{what}; {how} (or put a tokenizer_config.json with "eos_token" beside it)'

    def __str__(self) -> str:
        return self.explain()


class HFTokenizer:
    """A `tokenizer.json` file: `HFTokenizer("path/to/tokenizer.json")` (or the directory holding it).

    `eos_token` chooses the token appended to each document (any token of the vocabulary, usually
    one of its special tokens); by default it is the one the tokenizer declares (see the module
    docstring). `separator` is "eos" (appended to each document) or "bos" (put in front of each
    document); `separator_id` is its id. Ids are encoded without the tokenizer's own
    post-processing, so no document gets a special token twice.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None):
        try:
            import tokenizers  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the Hugging Face `tokenizers` library: pip install tokenizers (or mesh3d[text])"
            ) from e
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        text = path.read_text(encoding="utf-8")
        separator, token = ("eos", eos_token) if eos_token is not None else _declared_separator(text, path)
        self._setup(path, text, separator, token)
        if self.separator_id is None:
            if eos_token is not None:
                raise NoEOSTokenError(str(path), _special_tokens(json.loads(text)), chosen=eos_token)
            raise ValueError(f"{path}: the declared {separator.upper()} token {token!r} is not in its vocabulary")

    def _setup(self, path: Path, text: str, separator: str, token: str) -> None:
        from tokenizers import Tokenizer

        self.path, self._json = path, text
        self._tokenizer = Tokenizer.from_str(text)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.separator, self.separator_token = separator, token
        self.separator_id = self._tokenizer.token_to_id(token)
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.name = f"hf-{digest}-{separator}-{self.separator_id}"

    def __getstate__(self) -> dict:
        # Tokenizing worker processes rebuild the tokenizer from its JSON (small) rather than
        # relying on how the Rust object pickles.
        return {"path": str(self.path), "json": self._json, "separator": self.separator, "token": self.separator_token}

    def __setstate__(self, state: dict) -> None:
        self._setup(Path(state["path"]), state["json"], state["separator"], state["token"])

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` alone (no separator), as `dtype`."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        """`encode` of each text (bytes are read as UTF-8); the Rust library spreads one batch over its threads."""
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"{self.separator}={self.separator_token!r} (id {self.separator_id}))"
        )


def _special_tokens(spec: dict) -> list[str]:
    """The special tokens a tokenizer.json adds, in id order."""
    added = sorted(spec.get("added_tokens", []), key=lambda t: t.get("id", 0))
    return [t["content"] for t in added if t.get("special")]


def _declared_separator(tokenizer_json: str, path: Path) -> tuple[str, str]:
    """("eos" | "bos", token): what the tokenizer declares, most explicit declaration first."""
    config_path = path.parent / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for kind in ("eos", "bos"):
            token = config.get(f"{kind}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if token:
                return kind, token
    spec = json.loads(tokenizer_json)
    from_template = _template_special_tokens(spec.get("post_processor"))
    if from_template:
        return from_template
    special = _special_tokens(spec)
    for kind, known in (("eos", _KNOWN_EOS), ("bos", _KNOWN_BOS)):
        for token in known:
            if token in special:
                return kind, token
    if len(special) == 1:  # a tokenizer trained with a single special token: its end of text
        return "eos", special[0]
    raise NoEOSTokenError(str(path), special)


def _template_special_tokens(processor: dict | None) -> tuple[str, str] | None:
    """A TemplateProcessing's special token after the single sequence ("eos") or before it ("bos")."""
    if not processor:
        return None
    if processor.get("type") == "Sequence":
        for inner in processor.get("processors", []):
            found = _template_special_tokens(inner)
            if found:
                return found
        return None
    if processor.get("type") != "TemplateProcessing":
        return None
    single = processor.get("single", [])
    positions = [i for i, piece in enumerate(single) if "Sequence" in piece]
    if not positions:
        return None
    specials = [(i, piece["SpecialToken"]["id"]) for i, piece in enumerate(single) if "SpecialToken" in piece]
    after = [token for i, token in specials if i > positions[0]]
    before = [token for i, token in specials if i < positions[0]]
    if after:
        return "eos", after[0]
    if before:
        return "bos", before[-1]
    return None
