"""The once-per-step gradient reduction over dp, driven from inside the pipeline schedule.

Inside a step every backward but the last of each stage only accumulates locally (FSDP2 and DDP's
`set_requires_gradient_sync(False)`), and the last one reduces: one reduce-scatter (FSDP) or
all-reduce (DDP) per stage per step, not one per microbatch.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


class GradientSync:
    """Reduces each stage's gradients over dp once per step, on the stage's last backward.

    `before_backward` is the pipeline runtime's hook: the runtime knows which backward of a stage
    is its last in the step; every earlier one accumulates unreduced gradients (and, under FSDP,
    keeps parameters unsharded until the last one).
    """

    def __init__(self, stages: dict[int, nn.Module], reshard_between_backwards: bool = False):
        self.stages = stages
        self.reshard_between_backwards = reshard_between_backwards  # FSDP with reshard_after_forward=True
        self.synced_backwards = 0  # backwards that reduced gradients, over the life of the model

    def before_backward(self, stage: int, is_last: bool) -> None:
        module = self.stages[stage]
        module.set_is_last_backward(is_last)
        module.set_requires_gradient_sync(is_last)
        module.set_reshard_after_backward(is_last or self.reshard_between_backwards)
        self.synced_backwards += int(is_last)

    def after_weight_backward(self, stage: int) -> None:
        """After a split schedule's W (pipeline/backward_halves.py): it starts inside the graph, so
        FSDP's post-backward hooks, which sit on the input-gradient chain, did not run for it. Run
        what they and the end of an ordinary backward would: accumulate the new gradients, and on
        the stage's last backward reduce them (before_backward set the flags)."""
        self.stages[stage]._get_fsdp_state()._root_post_backward_final_callback()

    def end_forward_only(self) -> None:
        """After a forward-only pass (eval): reshard what the forwards gathered, so the optimizer's
        update of the shards is what the next forward gathers, and clear the per-iteration state
        that only a last backward would otherwise clear (torch's `reset_iter_state` on each root)."""
        for stage in self.stages.values():
            # A root that never ran a forward has nothing to reset, and torch's reset fails on it
            # (its lazy init has not run: the private `_is_root` is still None).
            if stage._get_fsdp_state()._is_root is not None:
                stage.reset_iter_state()

    def abort(self) -> None:
        """After a step raised: drop everything the failed step left inside FSDP/DDP.

        `reset_iter_state` (torch's recovery call on each root) waits for in-flight collectives,
        reshards and clears the per-iteration state, but keeps the unreduced gradients earlier
        backwards of the step accumulated on the unsharded parameters; the next step's last
        backward would reduce them too, and `zero_grad` does not reach them. They are cleared
        here through FSDP's internals (no public API reaches them; tests/distributed/test_composition.py
        fails if a torch version changes them, and docs/testing.md lists the versions it passed on).
        """
        self.end_forward_only()
        for stage in self.stages.values():
            for module in stage.modules():
                if not isinstance(module, FSDPModule):
                    continue
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        unsharded = getattr(fsdp_param, "_unsharded_param", None)
                        if unsharded is not None:
                            unsharded.grad = None
