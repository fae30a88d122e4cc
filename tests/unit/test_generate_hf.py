"""generate.py against transformers: a model exported with export_safetensors, loaded by
transformers' LlamaForCausalLM.from_pretrained, greedily writes the same tokens with
`generate(do_sample=False)` as generate.py does from the same directory; and the command line
picks the directory's tokenizer.json and writes that continuation.

One process: the export runs through a ParallelModel at pp = dp = tp = 1 (a private world of
one, no ports). `transformers` is a test dependency only.
"""

import pytest
import torch
import torch.distributed as dist
from generate_cases import strengthen
from text_corpus import END_OF_TEXT, documents, train_bpe

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.generate import generate, main
from examples.llama.model import Transformer
from examples.llama.sampling import Sampling
from examples.llama.trained_model import TrainedSource
from mesh3d.data import HFTokenizer

transformers = pytest.importorskip("transformers")

# 320 rows: room for a 300-token BPE tokenizer, and the byte tokenizer's 256.
ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=320, multiple_of=16, max_seq_len=64, rope_theta=10000.0
)
PROMPTS = [[3], [10, 20, 30, 40, 50], list(range(100, 112))]
NEW_TOKENS = 20


def export(directory, tied: bool) -> Transformer:
    """A plain model with decisive weights, written as Hugging Face safetensors by mesh3d; returned."""
    with torch.device("meta"):
        model = Transformer(ARGS.with_(tie_embeddings=tied))
    strengthen(model.to_empty(device="cpu"))
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(model, layout, schedule="gpipe", dp_mode="ddp")  # a CPU model keeps its values
        mesh3d.checkpoint.export_safetensors(pm, directory)
    finally:
        dist.destroy_process_group()
    return model


def transformers_greedy(directory, prompt: list[int]) -> list[int]:
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # LlamaConfig's default eos id 2 would end generation early
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_equal_transformers_generate(tmp_path, tied):
    export(tmp_path, tied)
    source = TrainedSource.open(tmp_path)
    assert source.kind == "huggingface" and source.config.tie_embeddings == tied
    model = source.load()
    for prompt in PROMPTS:
        ours = generate(model, prompt, NEW_TOKENS, Sampling(temperature=0))[0].tolist()
        assert ours == transformers_greedy(tmp_path, prompt), prompt


def test_the_command_line_uses_the_directory_tokenizer_and_writes_the_greedy_continuation(tmp_path, capsys):
    model = export(tmp_path, tied=False)
    tokenizer = HFTokenizer(train_bpe(tmp_path / "tokenizer.json", documents(40), vocab_size=300))
    assert tokenizer.separator_token == END_OF_TEXT and tokenizer.vocab_size < ARGS.vocab_size
    texts = main(
        [
            "--checkpoint",
            str(tmp_path),
            "--prompt",
            "the pipeline",
            "--prompt",
            "every rank",
            "--greedy",
            "--max-new-tokens",
            "12",
            "--device",
            "cpu",
        ]
    )
    expected = []
    for text in ("the pipeline", "every rank"):
        ids = [int(i) for i in tokenizer.encode(text)]
        new = generate(
            model.eval(),
            [tokenizer.separator_id] + ids,
            12,
            Sampling(temperature=0),
            stop_id=tokenizer.separator_id,
            vocab_size=tokenizer.vocab_size,
        )[0].tolist()
        assert max(new) < tokenizer.vocab_size
        new = new[: new.index(tokenizer.separator_id)] if tokenizer.separator_id in new else new
        expected.append(tokenizer.decode(ids + new))
    assert texts == expected
    assert all(text.startswith(prompt) for text, prompt in zip(texts, ("the pipeline", "every rank")))
    assert repr(tokenizer) in capsys.readouterr().out


def test_the_command_line_refuses_a_tokenizer_larger_than_the_model(tmp_path):
    export(tmp_path / "hf", tied=False)
    big = train_bpe(tmp_path / "big.json", documents(200), vocab_size=400)
    with pytest.raises(SystemExit, match=r"more than the model's vocabulary \(320\)"):
        main(["--checkpoint", str(tmp_path / "hf"), "--tokenizer", str(big), "--device", "cpu"])


@pytest.mark.parametrize(
    "flags, named",
    [(["--top-p", "1.5"], "--top-p"), (["--top-k", "0"], "--top-k"), (["--temperature", "-1"], "--temperature")],
)
def test_the_command_line_names_a_bad_sampling_flag(tmp_path, capsys, flags, named):
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), *flags])
    assert named in capsys.readouterr().err


def test_another_architecture_is_built_by_transformers_and_generates_what_its_generate_does(tmp_path, capsys):
    """A `train.py --hf-model qwen2 --export-hf` directory: transformers builds it (not the LLaMA example), and
    greedy tokens equal transformers' own generate(do_sample=False); the command line writes them."""
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    source = TrainedSource.open(tmp_path)
    assert source.kind == "transformers" and source.vocab_size == 320 and source.max_seq_len == 64
    model = source.load()
    reference = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id, reference.generation_config.pad_token_id = None, 0
    for prompt in PROMPTS:
        ours = generate(model, prompt, NEW_TOKENS, Sampling(temperature=0))[0].tolist()
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours == theirs[0, len(prompt) :].tolist(), prompt
    (text,) = main(["--checkpoint", str(tmp_path), "--prompt", "ab", "--greedy", "--max-new-tokens", "4"])
    assert text.startswith("ab") and "built by transformers" in capsys.readouterr().out


def test_a_checkpoint_of_an_hf_model_run_says_how_to_export_it(tmp_path):
    """generate.py reads a --hf-model run through its export; the message says the command, not a traceback."""
    step = tmp_path / "ckpt" / "step30"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "train_state.json").write_text('{"step": 30, "extra": {"args": {"hf_model": "qwen2"}}}')
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(step)])
    assert str(exit_.value) == (
        f"error: {step} is a checkpoint of train.py --hf-model qwen2; generate.py reads such a model from its "
        f"Hugging Face export. Export it (this trains nothing): train.py with the run's flags and --resume-from "
        f"{step} --steps 30 --export-hf DIR, then pass --checkpoint DIR"
    )
