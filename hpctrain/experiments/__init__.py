"""Experiments as files: sweeps become job arrays, reports read run directories only."""
