"""``hpctrain bench data JOB.toml --hdf5 FILE``: the data phase of the text and HDF5 readers.

Reads the job's training split (``data.source = "criteo"``) batch by batch, as one worker's
data phase does, with the Criteo text reader and with the same samples preprocessed into
``FILE`` (``hpctrain preprocess``), alternating passes so that a busy machine slows both
alike. Prints the median seconds per pass of each and the HDF5/text ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from hpctrain.config import JobConfig
from hpctrain.data import open_dataset
from hpctrain.data.hdf5 import HDF5Dataset
from hpctrain.data.types import Dataset
from hpctrain.errors import ConfigError

__all__ = ["add_arguments", "run", "COLUMNS"]

COLUMNS = ["reader", "batch", "samples", "s_per_pass", "samples_per_s", "vs_text"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hdf5", required=True, help="the job's data from `hpctrain "
                                                      "preprocess`")
    parser.add_argument("--batch", type=int, default=128, help="samples per read (default "
                                                               "128)")
    parser.add_argument("--passes", type=int, default=3, help="passes per reader after a "
                                                              "warm-up one; the median is shown")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace, config: JobConfig) -> list[dict[str, Any]]:
    if config.data.source != "criteo":
        raise ConfigError(f"bench data compares the Criteo text reader with its HDF5 file: "
                          f"data.source must be 'criteo', not {config.data.source!r}")
    if args.batch < 1 or args.passes < 1:
        raise ConfigError("bench data: --batch and --passes must be >= 1")
    readers: dict[str, Dataset] = {"text": open_dataset(config.data),
                                   "hdf5": HDF5Dataset(args.hdf5)}
    n = readers["text"].num_samples("train")
    if readers["hdf5"].num_samples("train") != n:
        raise ConfigError(f"{args.hdf5}: holds {readers['hdf5'].num_samples('train')} training "
                          f"samples, the job's text files {n}: not the same data")
    times: dict[str, list[float]] = {name: [] for name in readers}
    for index in range(args.passes + 1):
        for name, reader in readers.items():
            start = time.perf_counter()
            for a in range(0, n, args.batch):
                reader.read("train", a, min(n, a + args.batch))
            if index:  # the first pass warms the page cache for both
                times[name].append(time.perf_counter() - start)
    median = {name: float(np.median(t)) for name, t in times.items()}
    return [{"reader": name, "batch": args.batch, "samples": n, "s_per_pass": median[name],
             "samples_per_s": n / median[name], "vs_text": median[name] / median["text"]}
            for name in readers]
