"""The parts of one training step around the pipeline: the batch check, the global token-mean
loss, the gradient norm and clipping, and the finiteness check."""
