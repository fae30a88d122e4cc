"""mesh3d: train LLaMA-style models with pipeline x data x tensor (3D) parallelism on plain PyTorch.

layout = mesh3d.build_mesh(pp=2, dp=2, tp=2)        # a Layout
pm = mesh3d.parallelize(model, layout, ...)        # a ParallelModel; a silent peer: PeerTimeout
plans = mesh3d.plan(...)                           # Plan rows; Hardware (mesh3d.planner)
reports = mesh3d.dry_run(build_model, 1024, ...)   # a RankReport per rank: any rank of a big job, on this CPU
mesh3d.checkpoint, mesh3d.data, mesh3d.pipeline, mesh3d.train: the packages' faces
"""

from mesh3d import checkpoint, data, pipeline, train
from mesh3d.distributed.peer_timeout import PeerTimeout
from mesh3d.mesh import Layout, build_mesh
from mesh3d.parallel_model import ParallelModel
from mesh3d.parallelize import parallelize
from mesh3d.planner import Hardware, Plan, RankReport, dry_run, plan

__all__ = [
    "Hardware",
    "Layout",
    "ParallelModel",
    "PeerTimeout",
    "Plan",
    "RankReport",
    "build_mesh",
    "checkpoint",
    "data",
    "dry_run",
    "parallelize",
    "pipeline",
    "plan",
    "planner",
    "train",
]
__version__ = "0.1.0"
