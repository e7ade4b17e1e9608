"""Parallelism of the dense model: data parallel now; tensor and pipeline parallel build here."""
