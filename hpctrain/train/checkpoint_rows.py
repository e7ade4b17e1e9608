"""The checkpoint as embedding stores see it: where they write their rows and read them back.

A store saves and restores its own part (:meth:`embeddings.types.EmbeddingStore.save`); these
two adapters put that part into the checkpoint's files (:mod:`hpctrain.train.checkpoint`),
so that the trainer never asks which kind of store it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hpctrain.errors import CheckpointError
from hpctrain.train import checkpoint as ckpt

__all__ = ["RowFiles", "SavedRows"]


class RowFiles:
    """A :class:`~embeddings.types.RowSink` writing into checkpoint folder ``folder``."""

    def __init__(self, folder: Path, lead: bool) -> None:
        self.folder, self.lead = folder, lead
        self.files: list[ckpt.FileEntry] = []

    def write(self, name: str, rows: np.ndarray, weight: np.ndarray,
              state: np.ndarray) -> None:
        self.files.append(ckpt.write_rows(self.folder / name, rows, weight, state))


class SavedRows:
    """A :class:`~embeddings.types.RowSource` reading the rows of ``manifest`` (its row
    files, or the files ``names``)."""

    def __init__(self, manifest: ckpt.Manifest, names: list[str] | None = None) -> None:
        self.manifest = manifest
        self.step = manifest.step
        self.names = manifest.row_files() if names is None else names

    def rows(self, dim: int, state_width: int) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]]:
        folder = Path(self.manifest.path)
        for rows, weight, state in ckpt.read_rows(folder, self.names):
            if state.shape[1] != state_width or weight.shape[1] != dim:
                raise CheckpointError(f"checkpoint {folder}: rows of width {weight.shape[1]} "
                                      f"with {state.shape[1]} optimizer values do not fit "
                                      f"this job")
            yield rows, weight, state
