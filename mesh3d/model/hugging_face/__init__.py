"""Hugging Face causal LMs as transformers builds them: their anatomy from the config's
`base_model_pp_plan`, a check that their stages compute what their own forward computes, and
their tensor-parallel plan from `base_model_tp_plan`."""
