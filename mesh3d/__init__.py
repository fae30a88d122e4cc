"""mesh3d: train LLaMA-style models with pipeline x data x tensor (3D) parallelism on plain PyTorch."""

from mesh3d import data
from mesh3d.mesh import Layout, build_mesh

__all__ = ["Layout", "build_mesh", "data"]
__version__ = "0.1.0"
