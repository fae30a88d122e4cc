"""The LLaMA example's tp_plan, applied with torch's parallelize_module, matches a single process.

This checks the plan the model ships (sequence parallel, vocab-sharded embedding and head); the
composition with the pipeline and data axes is mesh3d.parallelize's job.
"""

import torch
from multiprocess import run_on_ranks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import mesh3d
from examples.llama.config import get_config
from examples.llama.model import Transformer, loss_fn

SEED = 3


def relative_error(got, want):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    return ((got - want).norm() / want.norm()).item()


def _tp_against_single_process():
    """On 8 ranks: for tp in 2, 4, 8, tied and untied, the worst relative error of logits, loss, grads."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32))
    references = {}
    for tied in (False, True):
        args = get_config("debug", n_layers=2, max_seq_len=64, tie_embeddings=tied)
        reference = Transformer(args)
        reference.init_weights(SEED)
        ref_logits = reference(tokens)
        loss_fn(ref_logits, tokens).backward()
        references[tied] = (args, ref_logits, dict(reference.named_parameters()))
    worst = {}
    for tp in (2, 4, 8):
        layout = mesh3d.build_mesh(pp=1, dp=-1, tp=tp)
        for tied in (False, True):
            args, ref_logits, ref_params = references[tied]
            with torch.device("meta"):
                model = Transformer(args)
            parallelize_module(model, layout.mesh["tp"], model.tp_plan)
            model.to_empty(device="cpu")
            model.init_weights(SEED)
            logits = model(tokens)
            loss_fn(logits, tokens).backward()

            errors = {"logits": relative_error(logits, ref_logits)}
            for name, param in model.named_parameters():
                errors[name] = max(
                    relative_error(param, ref_params[name]), relative_error(param.grad, ref_params[name].grad)
                )
            sharded = isinstance(model.layers["0"].attention.wq.weight, DTensor)
            worst[(tp, tied)] = (max(errors.values()), max(errors, key=errors.get), sharded)
    return worst


def test_tp_plan_matches_single_process():
    per_rank = run_on_ranks(_tp_against_single_process, 8, timeout=180)
    for rank, worst in enumerate(per_rank):
        assert len(worst) == 6
        for (tp, tied), (error, where, sharded) in worst.items():
            assert sharded, (tp, tied)
            assert error <= 1e-5, f"rank {rank}, tp={tp}, tied={tied}: relative error {error:.2e} at {where}"
