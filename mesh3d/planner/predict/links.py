"""The bandwidth each parallel axis's traffic gets at a layout: within a node or across nodes, by
where the axis's ranks sit (tp fastest, then cp, dp, pp), as NCCL moves a collective over them."""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.planner import constants as C
from mesh3d.planner.hardware import Hardware


@dataclass(frozen=True)
class Links:
    """Bytes/s each parallel axis's traffic gets (intra- or inter-node, by where its ranks sit)."""

    tp: float
    dp: float  # data parallelism's group: dp x cp
    pp: float
    cp: float = 0.0
    ep: float = 0.0  # expert parallelism's group: ep consecutive ranks of a stage
    replicas: float = 0.0  # HSDP's all-reduce between its groups: dp x cp x tp ranks, across nodes

    @classmethod
    def of(
        cls,
        hardware: Hardware,
        pp: int,
        dp: int,
        tp: int,
        gpus_per_node: int,
        cp: int = 1,
        ep: int = 1,
        dp_shard: int | None = None,
    ) -> Links:
        """Ranks are laid out tp fastest, then cp, dp, pp (axes.py): an axis stays in a node while
        its span of ranks fits in one. Under HSDP data parallelism's own traffic spans a group of
        `dp_shard` dp ranks, its all-reduce between groups the whole dp.

        A collective that spans nodes runs as NCCL runs it on nodes with a network port per GPU:
        one ring per port, so a group with k ranks in each node moves its bytes over k ports at
        once and its hops within the node over NVLink (nccl-tests' bus bandwidth across nodes of
        8 GPUs is about 8 ports' line rate). A group of one rank per node has its own port alone;
        a pipeline message and the experts' all-to-all (every rank's rows leave its node) do too."""

        def link(span: int, stride: int = gpus_per_node) -> float:
            """The bandwidth of a group of ranks `stride` apart spanning `span` consecutive ranks."""
            if span <= gpus_per_node:
                return hardware.intra_node_bandwidth * C.ACHIEVABLE_LINK_FRACTION
            ports = max(1, gpus_per_node // stride)
            bandwidth = min(hardware.intra_node_bandwidth, ports * hardware.inter_node_bandwidth)
            return bandwidth * C.ACHIEVABLE_LINK_FRACTION

        data = (dp_shard or dp) * cp * tp
        return cls(
            tp=link(tp),
            dp=link(data, stride=tp),
            pp=link(pp * dp * cp * tp),
            cp=link(cp * tp, stride=tp),
            ep=link(ep),
            replicas=link(dp * cp * tp, stride=data),
        )
