"""Tensor parallelism: plans of torch ParallelStyles, applied per pipeline stage."""

from mesh3d.tensor.apply import apply_tensor_parallel, check_loss_parallel_output, loss_context
from mesh3d.tensor.gradients import settle_gradients
from mesh3d.tensor.plan import TensorParallelConfig, check_plan, model_plan, resolve_plan, uses_sequence_parallel

__all__ = [
    "TensorParallelConfig",
    "apply_tensor_parallel",
    "check_loss_parallel_output",
    "check_plan",
    "loss_context",
    "model_plan",
    "resolve_plan",
    "settle_gradients",
    "uses_sequence_parallel",
]
