"""``hpctrain preprocess``: Criteo text files to the HDF5 click log, once, on one process.

The text is parsed exactly as training on ``data.source = "criteo"`` would parse it (same
split, hashing and bad-line rule), so a job gives the same samples from either source.
"""

from __future__ import annotations

import os
from typing import Any

from hpctrain.config import DataConfig
from hpctrain.data.criteo import CriteoText
from hpctrain.data.hdf5 import write_hdf5
from hpctrain.errors import ConfigError

__all__ = ["preprocess"]


def preprocess(config: DataConfig, out_path: str, progress: bool = False) -> dict[str, Any]:
    """Parse ``config.paths`` (and ``eval_paths``) as Criteo text and write ``out_path``.

    ``config.source`` is not consulted: the inputs are always read as text. Returns the
    summary of :func:`~hpctrain.data.hdf5.write_hdf5`.
    """
    target = os.path.realpath(out_path)
    for path in (*config.paths, *config.eval_paths):
        if os.path.realpath(path) == target:
            raise ConfigError(f"preprocess: the output {out_path} is also an input file")
    dataset = CriteoText(config.paths, config.table_sizes, eval_paths=config.eval_paths,
                         eval_fraction=config.eval_fraction, on_bad_line=config.on_bad_line)
    return write_hdf5(dataset, out_path, progress=progress)
