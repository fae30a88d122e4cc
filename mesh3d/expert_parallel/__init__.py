"""Expert parallelism: each block's experts split over the ep ranks of a stage, tokens sent to their
experts' ranks all-to-all (docs/parallelize.md#expert-parallelism).

plan.py reads which modules are experts (transformers' `base_model_ep_plan`); token_dispatch.py
moves the tokens; experts_style.py shards an experts module and runs its forward on the tokens it
is sent.
"""
