"""What the planner measures: a model's stages on fake tensors (probe), their seconds and data
parallelism's on this machine (part and data-parallel timing), and the machine itself (machine bench)."""
