"""Models torch.export can capture, split by torch's pipeline frontend at block boundaries: the
traced anatomy (several tensors per stage boundary, skip connections sent straight on)."""
