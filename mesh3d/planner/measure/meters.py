"""Meters the probe counts a stage's run with, torch's own hooks and dispatch modes; bench/ uses
SavedBytesMeter on real runs too.

- SavedBytesMeter: the bytes autograd keeps for backward (saved-tensor hooks), live and peak;
- CollectiveBytes: the bytes each rank sends through DTensor's functional collectives;
- ResultsOf: the bytes of the results of given ops (what "selective" checkpointing caches);
- ScoreMatrixBytes: the bytes an attention that writes its score matrix out moves through it;
- KernelsAsOnAGPU: SDPA's calls without dropout and dropout as one kernel, the kernels a GPU takes;
- CPU_ATTENTION_FLOPS: FlopCounterMode's formulas for the CPU attention kernel (a custom mapping).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from mesh3d.train.flops import GROUPED_MM_FLOPS


class CollectiveBytes(TorchDispatchMode):
    """Bytes each rank sends through the functional collectives DTensor issues, by ring algorithm:
    an all-gather of a local s sends (n-1)s, a reduce-scatter of S sends (n-1)S/n, an all-reduce
    of S twice that."""

    def __init__(self, ranks: int):
        super().__init__()
        self.ranks = ranks
        self.bytes = 0.0
        self.count = 0
        self.by_kind: dict[str, tuple[float, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if getattr(func, "namespace", "") in ("_c10d_functional", "c10d_functional") and tensors:
            size, n = tensors[0].numel() * tensors[0].element_size(), self.ranks
            sent = {
                "all_gather": (n - 1) * size,
                "reduce_scatter": (n - 1) * size / n,
                "all_reduce": 2 * (n - 1) * size / n,
            }
            kind = next((k for k in sent if name.startswith(k)), None)
            if kind is not None:
                self.count += 1
                self.bytes += sent[kind]
                total, count = self.by_kind.get(kind, (0.0, 0))
                self.by_kind[kind] = (total + sent[kind], count + 1)
        return func(*args, **(kwargs or {}))


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release to the meter when autograd drops
    it (after the backward that used it, or with a graph that never runs backward)."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedBytesMeter, key: int | None):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedBytesMeter:
    """Bytes autograd keeps for backward: live now (`now`) and at most (`peak`), as distinct storages.

    Use as `torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)`. A storage counts
    once however many ops save it (a norm's output feeding three projections, a view of a tensor
    already kept), at its `nbytes()` (what stays allocated), and stops counting when autograd drops
    its last saved reference: a saved tensor is held until its node's backward has run (with a split
    backward, until the weight half), not merely until it is unpacked, so the release is the handle's
    end. Parameters (and views of them) are not counted: a rank holds them anyway, and they are
    counted as parameters (or FSDP's gathered copy) once, not once per microbatch.
    """

    def __init__(self):
        self.now = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [saved references alive, nbytes]

    def pack(self, tensor: torch.Tensor) -> _Saved:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return _Saved(tensor.detach(), self, None)
        storage = local_shard(tensor).untyped_storage()
        key = storage._cdata  # unique while alive, and the handle keeps it alive
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        else:
            ref[0] += 1
        # Detached: an op that saves its own output (a softmax) would otherwise close a cycle, the
        # output -> its node -> this handle -> the output, that no collector sees (it runs through
        # C++), and a graph dropped without a backward (a "selective" forward's) would stay alive.
        # Autograd gives an unpacked tensor its node back itself.
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def reset_peak(self) -> None:
        self.peak = self.now

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.now -= ref[1]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ResultsOf(TorchDispatchMode):
    """Bytes of the distinct storages the given ops return (not parameters): what the runtime's
    "selective" checkpointing caches (pipeline/activation_checkpoint.py's SAVED_OPS).

    The storages are held, as the cache holds them: a storage's id is unique only while it lives,
    and a result the forward drops at once (a projection reshaped and rotated) would otherwise hand
    its id to a later result, which would then go uncounted. A DTensor result (the mode sees the op
    before DTensor splits it into local ops) counts as the local tensor the rank holds."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.total, self.storages = ops, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    storage = local_shard(t).untyped_storage()
                    if storage._cdata not in self.storages:
                        self.storages[storage._cdata] = storage
                        self.total += storage.nbytes()
        return out


class ScoreMatrixBytes(TorchDispatchMode):
    """Bytes read and written through attention score matrices: floating-point tensors whose last
    two dims are (queries, keys) and whose leading dims hold more than the microbatch (its heads), in
    every op but a view and a fused attention kernel. An attention that writes its scores out
    (transformers' "eager", SDPA's math kernel, Megatron-LM's kernels of 2021) moves them through
    memory several times a pass: memory-bound traffic no FLOP count sees. A fused kernel (flash,
    cuDNN, memory-efficient) keeps them on chip: 0."""

    def __init__(self, batch: int, queries: int, keys: int):
        super().__init__()
        self.batch, self.shape = batch, (queries, keys)
        self.total = self.forward = 0  # forward: the total when the forward ended (the probe sets it)

    def _score_bytes(self, t) -> int:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return 0
        t = local_shard(t)
        if t.dim() < 3 or tuple(t.shape[-2:]) != self.shape or math.prod(t.shape[:-2]) <= self.batch:
            return 0
        return t.numel() * t.element_size()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.namespace == "aten"
            and not func.is_view
            and func not in _FUSED_ATTENTION
            and func.overloadpacket not in _NO_TRAFFIC
        ):
            tensors = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))]
            self.total += sum(self._score_bytes(t) for t in tensors)
        return out


class KernelsAsOnAGPU(TorchFunctionMode):
    """The probe's calls as a GPU runs them, where a CPU takes other kernels at the same FLOPs:
    SDPA's calls without their dropout (on a CPU SDPA with dropout takes the math kernel, which
    writes the score matrix out; a GPU's flash kernel drops out on chip), and a dropout as one
    kernel with a mask of bytes (torch.native_dropout, a GPU's; a CPU's dropout makes a float mask
    and passes over it three times). So ScoreMatrixBytes counts what a GPU moves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        elif func is torch.nn.functional.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            p, training = bound.get("p", 0.5), bound.get("training", True)
            if training and 0 < p < 1:
                return torch.native_dropout(bound["input"], p, True)[0]
        return func(*args, **kwargs)


# The fake tensors live on CPU, where SDPA takes the CPU flash kernel: FlopCounterMode registers the
# CUDA attention kernels only, so without this the attention's FLOPs would not be counted at all.
# Torch's formulas count the whole score matrix, causal or not (the probe's call carries a mask,
# not is_causal, so it cannot tell): the convention of torchtitan's and PaLM's MFU.
def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
    **GROUPED_MM_FLOPS,  # experts' grouped matmuls
}


# Kernels that keep the score matrix on chip (ScoreMatrixBytes counts none of their operands), and
# ops that move no bytes of their own.
_FUSED_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    *(
        getattr(torch.ops.aten, name).default
        for name in (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_cudnn_attention_backward",
            "_flash_attention_forward",
            "_flash_attention_backward",
            "_efficient_attention_forward",
            "_efficient_attention_backward",
        )
        if hasattr(torch.ops.aten, name)
    ),
}
_NO_TRAFFIC = {
    getattr(torch.ops.aten, name)
    for name in ("_unsafe_view", "detach", "alias", "lift_fresh", "empty_like", "empty", "new_empty", "empty_strided")
}
