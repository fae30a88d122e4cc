"""mesh3d: train LLaMA-style models with pipeline x data x tensor (3D) parallelism on plain PyTorch."""

from mesh3d import checkpoint, data, pipeline, train
from mesh3d.mesh import Layout, build_mesh
from mesh3d.parallel_model import ParallelModel
from mesh3d.parallelize import parallelize
from mesh3d.distributed.peer_timeout import PeerTimeout
from mesh3d.planner import Hardware, Plan, plan

__all__ = [
    "Hardware", "Layout", "ParallelModel", "PeerTimeout", "Plan", "build_mesh", "checkpoint", "data", "parallelize", "pipeline",
    "plan", "planner", "train",
]
__version__ = "0.1.0"
