"""Data: token sources, byte tokenizer, samples, and the deterministic data-parallel loader."""

from mesh3d.data.corpus import load_token_file, stdlib_sources, tokenize_files
from mesh3d.data.dataset import TokenDataset
from mesh3d.data.loader import DistributedLoader
from mesh3d.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "DistributedLoader", "TokenDataset", "load_token_file", "stdlib_sources", "tokenize_files"]
