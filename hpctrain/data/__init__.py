"""Data sources: synthetic Zipf click logs, Criteo text files, preprocessed HDF5.

All yield :class:`~hpctrain.data.types.Batch` through random access by sample index;
:mod:`hpctrain.data.sharding` assigns samples to steps and workers.
"""

from __future__ import annotations

from hpctrain.config import DataConfig
from hpctrain.data.types import Batch, Dataset
from hpctrain.errors import ConfigError

__all__ = ["Batch", "Dataset", "open_dataset"]


def open_dataset(config: DataConfig) -> Dataset:
    """The dataset ``config.source`` names (imports only the reader it needs)."""
    if config.source == "synthetic":
        from hpctrain.data.synthetic import SyntheticClicks

        return SyntheticClicks(config.table_sizes, config.train_samples, config.eval_samples,
                               config.zipf, config.seed)
    if config.source == "criteo":
        from hpctrain.data.criteo import CriteoText

        return CriteoText(config.paths, config.table_sizes, eval_paths=config.eval_paths,
                          eval_fraction=config.eval_fraction, on_bad_line=config.on_bad_line)
    from hpctrain.data.hdf5 import HDF5Dataset

    if len(config.paths) != 1:
        raise ConfigError(f"data.paths: data.source = 'hdf5' reads one file from "
                          f"`hpctrain preprocess`, got {len(config.paths)}")
    return HDF5Dataset(config.paths[0])
