"""A --token-file with an id outside the model's vocabulary: refused when the file is opened, before
the model is parallelized, as one `error:` line naming the id and its index in the file, printed once;
both ranks exit with status 2, no traceback."""

import numpy as np
from train_launch import run_train

from examples.llama.config import get_config

VOCAB = get_config("debug").vocab_size  # train.py's default --config, whose vocabulary a token file keeps


def test_a_bad_id_in_a_token_file_is_refused_when_it_is_opened(tmp_path):
    tokens = np.arange(4096, dtype=np.uint16) % VOCAB
    tokens[1234] = VOCAB + 44
    np.save(tmp_path / "tokens.npy", tokens)
    argv = ["--token-file", str(tmp_path / "tokens.npy"), "--dp", "2", "--seq-len", "16", "--n-layers", "2"]
    done = run_train([*argv, "--steps", "1", "--metrics", ""], nproc=2, timeout=120, check=False)
    said = done.stdout + done.stderr
    line = (
        f"--token-file {tmp_path / 'tokens.npy'}: token id {VOCAB + 44} at index 1234 (of 4096) is outside "
        f"[0, {VOCAB}): the model's vocab_size is {VOCAB}"
    )
    assert done.rank_returncodes == [2, 2] and said.count(line) == 1, said[-3000:]
    assert "Traceback" not in said and "parameters" not in done.stdout, said[-3000:]  # before the run summary
