"""Collectives on numpy buffers over an explicit communicator."""
