"""A mixture-of-experts config that asks for the router's auxiliary loss: refused, not approximated.

With `output_router_logits` set, transformers' causal LM adds `router_aux_loss_coef` times a
load-balancing loss to the cross-entropy when it is given labels: every layer's router logits for
the whole batch concatenated, then the mean share of tokens each expert gets times the mean
probability the router gives it, summed over experts. That is a product of means over all layers
and all tokens together, neither a sum of per-stage terms (the layers live on different pipeline
stages) nor of per-microbatch terms (each microbatch's loss goes backward on its own), so a
pipeline's loss could only approximate it. mesh3d's loss is the cross-entropy of the logits, which
is transformers' own loss exactly when `output_router_logits` is off; with it on, the architecture
is refused by name rather than trained toward a different objective.
"""

from __future__ import annotations


def router_loss_problem(config) -> str | None:
    """Why mesh3d cannot take the config's router loss, or None when the config asks for none."""
    if not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(config, "router_aux_loss_coef", None)
    return (
        f"its config asks for the router's auxiliary loss (output_router_logits=True, router_aux_loss_coef={coef}), "
        "which transformers computes over every layer's router logits of the whole batch at once (a product of "
        "means over layers and tokens), not a sum over pipeline stages or microbatches, so mesh3d's loss could not "
        "equal it; set config.output_router_logits = False to train the cross-entropy alone"
    )
