"""Tensor parallelism: plans of torch ParallelStyles, applied per pipeline stage."""

from mesh3d.tensor.apply import apply_tensor_parallel, loss_context
from mesh3d.tensor.plan import check_plan, model_plan, resolve_plan, uses_sequence_parallel

__all__ = ["apply_tensor_parallel", "check_plan", "loss_context", "model_plan", "resolve_plan", "uses_sequence_parallel"]
