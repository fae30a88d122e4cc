"""Tensor parallelism: plans of torch ParallelStyles, applied per pipeline stage. Nothing here is
called from outside mesh3d (a plan is passed to `parallelize(tp_plan=)`), so this face exports nothing."""
