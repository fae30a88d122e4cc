"""train.py --document-mask: packed documents trained with block-causal attention and positions
restarting at each document, on a corpus of short documents (a 32-byte window holds one or two
boundaries).

- The mask is real: the first step's loss differs from the same run without it.
- A 4-step run in one process saves at step 2 and evaluates its held-out batch; its step-2
  checkpoint resumed on 2 ranks at pp = 2 gives steps 3-4 and the step-4 eval loss of the
  uninterrupted run (relative error <= 1e-4, as test_torchrun.py): the document ids come from
  the tokens, so the data position the checkpoint keeps is all a resume needs.
"""

import json
import shutil

from test_torchrun import _assert_close, _losses
from test_train_checkpoint import _run
from text_corpus import documents, write_jsonl


def test_document_mask_trains_and_resumes_under_another_layout(tmp_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", documents(300))
    common = ["--n-layers", "2", "--data", str(corpus), "--eval-every", "2", "--eval-batches", "1"]
    plain = tmp_path / "plain.jsonl"
    _run("--steps", "1", *common, "--metrics", str(plain))
    ckpt, straight = tmp_path / "ckpt", tmp_path / "straight.jsonl"
    masked = [*common, "--document-mask", "--checkpoint-dir", str(ckpt)]
    _run("--steps", "4", *masked, "--checkpoint-every", "2", "--metrics", str(straight))
    first = _losses(straight)[0]
    assert abs(first - _losses(plain)[0]) > 1e-4 * abs(first), "the mask changed nothing"  # 100x the tolerance

    resume_dir, resumed = tmp_path / "resume", tmp_path / "resumed.jsonl"
    resume_dir.mkdir()
    shutil.copytree(ckpt / "step2", resume_dir / "step2")
    masked[-1] = str(resume_dir)
    done = _run("--steps", "4", *masked, "--resume", "--pp", "2", "--metrics", str(resumed), torchrun=2)
    assert f"resumed from {resume_dir / 'step2'} (step 2)" in done.stdout
    _assert_close(_losses(resumed), _losses(straight)[2:])
    evals = [
        [json.loads(line).get("eval_loss") for line in path.read_text().splitlines()] for path in (straight, resumed)
    ]
    _assert_close([evals[1][-1]], [evals[0][-1]])
