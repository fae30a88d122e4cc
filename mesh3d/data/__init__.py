"""Data: token sources and cache, tokenizers, samples, the held-out split and the deterministic data-parallel loader.

sources: expand_data_paths, stdlib_sources, tokenize_files, load_token_file, build_token_cache
tokenizers: ByteTokenizer, HFTokenizer; the byte tokenizer as a tokenizer.json (write_byte_tokenizer, open_tokenizer)
samples: TokenDataset, split_heldout -> SampleSubset; DistributedLoader (each dp rank its share)
"""

from mesh3d.data.byte_tokenizer import ByteTokenizer
from mesh3d.data.byte_tokenizer_file import open_tokenizer, write_byte_tokenizer
from mesh3d.data.corpus import load_token_file, stdlib_sources, tokenize_files
from mesh3d.data.dataset import TokenDataset
from mesh3d.data.heldout import SampleSubset, split_heldout
from mesh3d.data.hf_tokenizer import HFTokenizer
from mesh3d.data.loader import DistributedLoader
from mesh3d.data.sources import expand_data_paths
from mesh3d.data.token_cache import build_token_cache

__all__ = [
    "ByteTokenizer",
    "DistributedLoader",
    "HFTokenizer",
    "SampleSubset",
    "TokenDataset",
    "build_token_cache",
    "expand_data_paths",
    "load_token_file",
    "open_tokenizer",
    "split_heldout",
    "stdlib_sources",
    "tokenize_files",
    "write_byte_tokenizer",
]
