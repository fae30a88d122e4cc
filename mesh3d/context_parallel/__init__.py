"""Context parallelism: each sequence cut over the cp ranks, attention made whole again (mesh3d-internal)."""
