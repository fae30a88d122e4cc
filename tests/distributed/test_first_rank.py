"""agree.from_first_rank: work every rank would repeat, done on rank 0 and handed to the others.

On 3 ranks: the result reaches every rank while the others run `meanwhile` only; an error on rank 0
(a ValueError), in another rank's `meanwhile` (an OSError), or of a type that is not builtin,
raises on every rank, each rank its own where it failed, the same type elsewhere (a RuntimeError
naming a non-builtin type): rank 0's with the same text everywhere, another rank's naming it; and
nothing hangs.
"""

from multiprocess import run_on_ranks


class ModelError(Exception):
    """An error type of the user's own (not builtin: it travels by name)."""


def _cases() -> dict:
    import torch.distributed as dist

    from mesh3d.distributed.agree import from_first_rank

    dist.init_process_group("gloo")
    rank, ran = dist.get_rank(), []
    out = {"result": from_first_rank(lambda: ran.append("compute") or [rank, "names"], lambda: ran.append("meanwhile"))}
    out["ran"] = ran

    def fails_on_rank_0():
        raise ValueError("no such module")

    def fails_on_rank_2():
        if rank == 2:
            raise OSError("disk full")

    def own_error():
        raise ModelError("shapes differ")

    for name, compute, meanwhile in [
        ("rank 0", fails_on_rank_0, None),
        ("meanwhile", lambda: None, fails_on_rank_2),
        ("own type", own_error, None),
    ]:
        try:
            from_first_rank(compute, meanwhile)
            out[name] = None
        except Exception as error:  # noqa: BLE001 - what each rank raised is the result
            out[name] = (type(error).__name__, str(error))
    dist.destroy_process_group()
    return out


def test_the_first_ranks_result_or_error_reaches_every_rank():
    for rank, out in enumerate(run_on_ranks(_cases, 3, timeout=60)):
        assert out["result"] == [0, "names"], out
        assert out["ran"] == (["compute"] if rank == 0 else ["meanwhile"]), out
        assert out["rank 0"] == ("ValueError", "no such module"), out
        assert out["meanwhile"] == ("OSError", "disk full" + ("" if rank == 2 else " (found on rank 2)")), out
        own = ("ModelError", "shapes differ") if rank == 0 else ("RuntimeError", "ModelError: shapes differ")
        assert out["own type"] == own, out
