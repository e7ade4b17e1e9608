"""Durable writes: what an atomic replace needs besides ``os.replace``."""

from __future__ import annotations

import os

__all__ = ["fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's data, or a folder's entries (so a rename in it survives a crash), to
    disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
