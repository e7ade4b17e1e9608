"""``hpctrain bench dlrm [JOB.toml]``: hpctrain's training step against a plain-torch step.

One process (``hpctrain bench dlrm`` or ``mpiexec -n 1``) times, interleaved round by round
so that a busy machine slows every case alike (every other round in reverse order, so that no
case always runs after the same one), at each ``--batch-sizes``:

- ``hpctrain``: :meth:`Trainer.step` on the job's model and tables (batches read before
  timing: the step only, without the data phase);
- ``hpctrain traced``: the same with ``runtime.trace`` on, run next to it; the median over
  the rounds of its time over the untraced one's is the tracing overhead;
- ``torch``: the DLRM reference's way: one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per
  table, the same dense model (hpctrain's layers and initial values) run by autograd as the
  reference writes it (``nn.Sequential`` MLPs, the dot products as ``bmm`` and an index of
  the lower triangle), ``torch.optim.SGD`` over all parameters, mean BCE loss;
- ``MLP only``: forward and backward of the bottom and top MLPs alone (fixed numbers in
  place of the dot products, no optimizer): the bound a step cannot beat.

All cases run on the job's dense device (``runtime.device``; CUDA steps are timed to a
``torch.cuda.synchronize``). Each case's figure is the median per-step time over ``--rounds``
rounds of ``--steps`` steps, after one warm-up round. ``vs_torch`` is samples/s over the
torch step's.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import JobConfig
from hpctrain.data import Batch, open_dataset
from hpctrain.errors import ConfigError
from hpctrain.models.dlrm import DLRM, interaction_width
from hpctrain.runtime import trace
from hpctrain.runtime.world import Topology

__all__ = ["add_arguments", "run", "COLUMNS"]

COLUMNS = ["batch", "case", "ms_per_step", "samples_per_s", "vs_torch"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 2048],
                        metavar="B", help="mini-batch sizes (default: 128 2048)")
    parser.add_argument("--steps", type=int, default=20, help="steps per case and round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds after a warm-up one; the median is shown")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace, config: JobConfig, topo: Topology
        ) -> list[dict[str, Any]]:
    """The rows (module doc); one process only."""
    if topo.world.Get_size() != 1:  # (so no parameter server and no tp/pp grid either)
        raise ConfigError(f"bench dlrm runs in one process, not {topo.world.Get_size()} "
                          f"(launch it without mpiexec, or with -n 1)")
    if min(args.steps, args.rounds, *args.batch_sizes) < 1:
        raise ConfigError("bench dlrm: --steps, --rounds and --batch-sizes must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-dlrm-") as scratch:
        for batch_size in args.batch_sizes:
            rows += _one_size(args, config, topo, batch_size, scratch)
    return rows


def _one_size(args: argparse.Namespace, config: JobConfig, topo: Topology, batch_size: int,
              scratch: str) -> list[dict[str, Any]]:
    train = dataclasses.replace(config.train, batch_size=batch_size, accumulate=1,
                                run_dir=f"{scratch}/run-{batch_size}", progress=False,
                                eval_every=0)
    config = dataclasses.replace(config, train=train)
    dataset = open_dataset(config.data)
    count = max(1, min(8, dataset.num_samples("train") // batch_size))
    batches = [dataset.read("train", i * batch_size, (i + 1) * batch_size)
               for i in range(count)]
    hpctrain_step = _hpctrain(config, topo, dataset, batches)
    path = f"{scratch}/trace-{batch_size}.json"

    def traced(steps: int) -> float:
        trace.start(path, topo.world, "worker")
        try:
            return hpctrain_step(steps)
        finally:
            trace.finish(topo.world)

    cases = {"hpctrain": hpctrain_step, "hpctrain traced": traced,
             "torch": _plain_torch(config, dataset.table_sizes, batches, topo.device),
             "MLP only": _mlp_only(config, len(dataset.table_sizes), batches, topo.device)}
    times = _rounds(cases, args.rounds, args.steps)
    median = {name: float(np.median(t)) for name, t in times.items()}
    torch_rate = batch_size / median["torch"]
    rows = [{"batch": batch_size, "case": name, "ms_per_step": median[name] * 1e3,
             "samples_per_s": batch_size / median[name],
             "vs_torch": batch_size / median[name] / torch_rate}
            for name in ("hpctrain", "torch", "MLP only", "hpctrain traced")]
    # paired round by round (the two ran next to each other): a drift in the machine's speed
    # over the rounds cancels out of each pair
    rows[-1]["overhead"] = float(np.median(np.divide(times["hpctrain traced"],
                                                     times["hpctrain"])))
    return rows


def _rounds(cases: dict[str, Callable[[int], float]], rounds: int, steps: int
            ) -> dict[str, list[float]]:
    """Each case's seconds per step in each of ``rounds`` rounds of ``steps`` steps, after a
    warm-up round (numba compiles, allocators settle). Every other round runs the cases in
    reverse order: a case's place in the round (what ran before it, in the caches) would
    otherwise bias it the same way every round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds + 1):
        for name, case in list(cases.items())[::1 if round_ % 2 else -1]:
            seconds = case(steps) / steps
            if round_:
                times[name].append(seconds)
    return times


def _hpctrain(config: JobConfig, topo: Topology, dataset, batches: list[Batch]
              ) -> Callable[[int], float]:
    from hpctrain.train.job import TrainingJob  # the CLI imports this module to parse

    trainer = TrainingJob(config, topo, dataset=dataset).worker()
    done = [0]

    def steps(n: int) -> float:
        feed = iter([(i % len(batches), batches[i % len(batches)]) for i in range(n)])
        start = time.perf_counter()
        for _ in range(n):
            trainer.step(done[0], feed, [])
            done[0] += 1
        return _elapsed(start, topo.device)

    return steps


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _plain_torch(config: JobConfig, sizes: tuple[int, ...], batches: list[Batch],
                 device: torch.device) -> Callable[[int], float]:
    """The reference DLRM's step: EmbeddingBag per table (sparse gradients) and SGD."""
    torch.manual_seed(config.train.seed)
    dim = config.model.embedding_dim
    model = DLRM(config.model, len(sizes)).to(device)
    tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
                           for n in sizes).to(device)
    optimizer = torch.optim.SGD([*model.parameters(), *tables.parameters()],
                                lr=config.train.lr)
    inputs = [(torch.from_numpy(b.dense).to(device), [torch.from_numpy(np.ascontiguousarray(
        b.sparse[:, t])).to(device) for t in range(len(sizes))],
        torch.arange(len(b), device=device), torch.from_numpy(b.labels).to(device))
        for b in batches]

    def steps(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            dense, ids, offsets, labels = inputs[i % len(inputs)]
            optimizer.zero_grad()
            embedded = torch.stack([table(x, offsets) for table, x in zip(tables, ids,
                                                                        strict=True)], dim=1)
            loss = F.binary_cross_entropy_with_logits(reference_logits(model, dense, embedded),
                                                      labels)
            loss.backward()
            optimizer.step()
        return _elapsed(start, device)

    return steps


def reference_logits(model: DLRM, dense: torch.Tensor, embedded: torch.Tensor
                     ) -> torch.Tensor:
    """``model``'s logits computed as the DLRM reference writes its forward, every backward
    autograd's: the MLPs' modules, the dot products as ``bmm`` indexed by the lower triangle
    (its ``interact_features``), not hpctrain's own backward of the pairs."""
    x = model.bottom(dense)
    features = torch.cat([x.unsqueeze(1), embedded], dim=1)
    rows, cols = torch.tril_indices(features.shape[1], features.shape[1], offset=-1,
                                    device=features.device)
    dots = torch.bmm(features, features.transpose(1, 2))[:, rows, cols]
    return model.top(torch.cat([x, dots], dim=1)).squeeze(1)


def _mlp_only(config: JobConfig, num_tables: int, batches: list[Batch],
              device: torch.device) -> Callable[[int], float]:
    """Forward and backward of the two MLPs alone: the bound of any DLRM step."""
    torch.manual_seed(config.train.seed)
    model = DLRM(config.model, num_tables).to(device)
    dim = config.model.embedding_dim
    dots = interaction_width(num_tables, dim) - dim
    inputs = [(torch.from_numpy(b.dense).to(device), torch.randn(len(b), dots, device=device),
               torch.from_numpy(b.labels).to(device)) for b in batches]

    def steps(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            dense, fixed, labels = inputs[i % len(inputs)]
            model.zero_grad(set_to_none=False)
            logits = model.top(torch.cat([model.bottom(dense), fixed], dim=1)).squeeze(1)
            F.binary_cross_entropy_with_logits(logits, labels).backward()
        return _elapsed(start, device)

    return steps
