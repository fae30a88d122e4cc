"""The byte tokenizer's tokenizer.json (mesh3d.data.write_byte_tokenizer), which a byte-level run's
--export-hf holds: the `tokenizers` library, transformers' AutoTokenizer and HFTokenizer encode
with it exactly as ByteTokenizer does, the end of a document included, and mesh3d reads it back as
the ByteTokenizer itself."""

import pytest

from mesh3d.data import ByteTokenizer, HFTokenizer, open_tokenizer, write_byte_tokenizer
from mesh3d.data.byte_tokenizer_file import is_byte_tokenizer_file

tokenizers = pytest.importorskip("tokenizers")

# Every kind of byte: ASCII, two- to four-byte UTF-8, controls, whitespace runs, the end of a
# document (byte 0), and "Ā", the character byte 0 has in the byte-level alphabet.
SAMPLE = "def héllo(x):\n\treturn x  # wörld 日本語 🤖\r\n\x00Ā\x7f\x01 end\x00"


def test_every_reader_encodes_as_the_byte_tokenizer(tmp_path):
    path = write_byte_tokenizer(tmp_path)
    expected = [int(i) for i in ByteTokenizer().encode(SAMPLE)]
    assert expected == list(SAMPLE.encode("utf-8"))

    rust = tokenizers.Tokenizer.from_file(str(path))
    assert rust.get_vocab_size(with_added_tokens=True) == 256
    assert rust.encode(SAMPLE, add_special_tokens=False).ids == expected
    assert rust.decode(expected, skip_special_tokens=False) == SAMPLE

    hf = HFTokenizer(path)
    assert (hf.vocab_size, hf.separator, hf.separator_id) == (256, "eos", 0)
    assert [int(i) for i in hf.encode(SAMPLE)] == expected


def test_transformers_reads_the_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_byte_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (len(tokenizer), tokenizer.eos_token_id) == (256, 0)
    ids = tokenizer(SAMPLE)["input_ids"]
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tokenizer.decode(ids) == SAMPLE


def test_mesh3d_reads_it_back_as_the_byte_tokenizer(tmp_path):
    path = write_byte_tokenizer(tmp_path)
    assert isinstance(open_tokenizer(path), ByteTokenizer) and isinstance(open_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(open_tokenizer(path, eos_token="\x00"), HFTokenizer)  # a chosen token: read as a file
    other = tmp_path / "other.json"
    other.write_text(path.read_text().replace('"merges": []', '"merges": [["a", "b"]]'))
    assert not is_byte_tokenizer_file(other) and not is_byte_tokenizer_file(tmp_path / "missing.json")
