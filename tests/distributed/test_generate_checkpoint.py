"""generate.py from a checkpoint saved by 2 ranks: the model it loads in one process is the one that
was saved, and greedily writes what that model writes.

Two ranks save the same weights as train.py does (its arguments in `extra["args"]`) at
(pp, dp, tp) = (2, 1, 1) and (1, 1, 2); the vocabulary (320, padded past the config's 256) is
taken from the saved tensors, the tokenizer from the saved arguments. In this process,
`TrainedSource` opens each checkpoint directory (its newest checkpoint), loads it at
pp = dp = tp = 1, and its weights equal the saving ranks' gathered state exactly; greedy
generation with the KV cache gives the tokens of a full-forward loop over that state.
"""

from __future__ import annotations

import numpy as np
import torch
from generate_cases import full_forward_greedy, strong_value
from multiprocess import run_on_ranks
from text_corpus import documents, train_bpe

import mesh3d
from examples.llama.config import get_config
from examples.llama.generate import generate
from examples.llama.model import Transformer
from examples.llama.sampling import Sampling
from examples.llama.trained_model import TrainedSource

SEQ_LEN = 16
ARGS = get_config("debug", n_layers=2, vocab_size=320, max_seq_len=SEQ_LEN)
LAYOUTS = {"pp2": (2, 1, 1), "tp2": (1, 1, 2)}
PROMPTS = [[7], [40, 41, 42, 43, 44]]
NEW_TOKENS = 12


def _save(root: str, tokenizer: str) -> dict[str, dict[str, np.ndarray]]:
    """Each layout: decisive weights, saved as train.py saves; the whole state as numpy."""
    saved = {}
    for name, sizes in LAYOUTS.items():
        layout = mesh3d.build_mesh(*sizes)
        with torch.device("meta"):
            model = Transformer(ARGS)
        pm = mesh3d.parallelize(model, layout)
        pm.load_full_state_dict({n: strong_value(n, tuple(shape)) for n, (shape, _) in pm.state_map.specs.items()})
        train_args = {"config": "debug", "n_layers": 2, "vocab_size": None, "seq_len": SEQ_LEN, "tokenizer": tokenizer}
        mesh3d.checkpoint.save(f"{root}/{name}/step3", pm, step=3, extra={"args": train_args})
        saved[name] = {k: v.numpy() for k, v in pm.full_state_dict().items()}
    return saved


def test_a_checkpoint_saved_by_two_ranks_generates_what_the_saved_model_does(tmp_path):
    tokenizer = train_bpe(tmp_path / "tokenizer.json", documents(40), vocab_size=300)
    saved = run_on_ranks(_save, 2, str(tmp_path), str(tokenizer), timeout=180)[0]
    for name, sizes in LAYOUTS.items():
        source = TrainedSource.open(tmp_path / name)  # a directory of checkpoints: its newest
        assert source.kind == "checkpoint" and source.path == tmp_path / name / "step3"
        assert (source.config.vocab_size, source.config.n_layers, source.config.max_seq_len) == (320, 2, SEQ_LEN)
        assert source.tokenizer_path == tokenizer
        assert f"pp={sizes[0]} dp={sizes[1]} tp={sizes[2]}" in source.description
        model = source.load(max_seq_len=max(map(len, PROMPTS)) + NEW_TOKENS)
        state = model.state_dict()
        assert sorted(state) == sorted(saved[name])
        for key, value in saved[name].items():
            assert np.array_equal(state[key].numpy(), value), (name, key)

        reference = Transformer(ARGS.with_(max_seq_len=32))
        reference.load_state_dict({k: torch.from_numpy(v) for k, v in saved[name].items()})
        for prompt in PROMPTS:
            got = generate(model, prompt, NEW_TOKENS, Sampling(temperature=0))[0].tolist()
            assert got == full_forward_greedy(reference.eval(), prompt, NEW_TOKENS), (name, prompt)
