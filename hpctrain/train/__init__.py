"""The training loop, its metrics and its run directory."""
