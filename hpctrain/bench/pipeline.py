"""``hpctrain bench pipeline``: bubble and activation memory of GPipe and 1F1B, measured.

For each ``p`` the first ``p`` workers form a pipeline (the others wait, sleeping, so they
take no CPU) over a deep MLP of ``layers`` equal ``width x width`` layers, split evenly, the
input asking for its gradient so that all stages do the same work; each ``(schedule, m)``
runs once to warm up and then ``repeats`` times (medians are reported). Every action's
wall-clock span and process CPU time is recorded on its stage and gathered on stage 0.

Three bubbles (idle share of the makespan, averaged over stages) come out of each run:

- ``bubble``: on the timeline of the executed orders and their real dependencies
  (:func:`~hpctrain.parallel.schedules.timeline`) when each stage's forwards and backwards
  take that stage's least-disturbed (minimum) measured CPU time over the row's runs. CPU
  time does not stretch when ranks share cores, and interference from other processes only
  ever adds to it, so this is the bubble of the schedule with the stages' own costs on
  dedicated cores with free communication, stable on a busy shared machine.
- ``jittered``: the same replay with every action's own CPU time, so the run-to-run jitter
  of each action (about 10-20 % on a shared VM) adds its waiting.
- ``wall``: from wall-clock timestamps (stage busy time over the makespan of the run):
  the direct measurement, which includes communication and, with more ranks than cores,
  time slicing.

``peak_held`` is the most micro-batches whose activations one stage held at once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from mpi4py import MPI
from torch import nn

from hpctrain.bench import report
from hpctrain.comm.owner import Communicators, communicators
from hpctrain.errors import ConfigError
from hpctrain.parallel.groups import parallel_groups
from hpctrain.parallel.pipeline import PipelineStage, Traced
from hpctrain.parallel.schedules import SCHEDULES, bubble, ideal_bubble, timeline
from hpctrain.parallel.stages import split_sequential
from hpctrain.runtime.topology import Grid
from hpctrain.runtime.world import GridComms, Topology, available_cores, build_grid

__all__ = ["PipelineRow", "PipelineBench", "format_rows", "write_json"]


@dataclass(frozen=True)
class PipelineRow:
    schedule: str
    p: int
    m: int
    bubble: float
    jittered: float
    wall: float
    ideal: float
    peak_held: int
    step_ms: float
    stage_s: tuple[tuple[float, float], ...] = ()
    """Per stage, the least CPU seconds of a forward and of a backward: the costs
    ``bubble`` is modelled with."""


@dataclass(frozen=True)
class PipelineBench:
    """What to measure; checked against the world size before any message."""

    stages: tuple[int, ...] = (2, 4)
    micro_batches: tuple[int, ...] = (1, 4, 8, 16)
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    width: int = 1024
    layers: int = 8
    micro_batch: int = 64
    repeats: int = 3

    def check(self, workers: int) -> None:
        if max(self.stages) > workers:
            raise ConfigError(f"bench pipeline: p = {max(self.stages)} stages need as many "
                              f"workers, the job has {workers}; launch mpiexec -n "
                              f"{max(self.stages)}")
        if max(self.stages) > self.layers or min(self.stages) < 1:
            raise ConfigError(f"bench pipeline: p = {list(self.stages)} must lie in "
                              f"[1, --layers = {self.layers}]")
        if min(self.micro_batches) < 1 or self.repeats < 1 or self.micro_batch < 1:
            raise ConfigError("bench pipeline: --m, --repeats and --micro-batch must be >= 1")
        if self.width < 1:
            raise ConfigError(f"bench pipeline: --width {self.width}: expected at least 1")
        if unknown := set(self.schedules) - set(SCHEDULES):
            raise ConfigError(f"bench pipeline: unknown schedule {sorted(unknown)}; "
                              f"choose from {sorted(SCHEDULES)}")

    def run(self, topo: Topology) -> list[PipelineRow] | None:
        """Every row on worker 0, ``None`` elsewhere; collective over the workers."""
        self.check(topo.workers)
        rendezvous = topo.rendezvous() if topo.backend == "torch" else None
        rows: list[PipelineRow] = []
        for p in self.stages:
            grid = build_grid(topo.role_comm, Grid(1, 1, p), rendezvous, topo.torch_backend)
            if grid is not None:
                rows += self._stage_rows(p, grid, topo.device, communicators(topo))
                grid.free()
            _sleeping_barrier(topo.role_comm)
        return rows if topo.worker_rank == 0 else None

    def _stage_rows(self, p: int, grid: GridComms, device: torch.device,
                    owner: Communicators) -> list[PipelineRow]:
        groups = parallel_groups(grid, owner)
        comm = grid.comms["pipeline"]
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(self.layers)
                                for m in (nn.Linear(self.width, self.width), nn.ReLU())))
        module = split_sequential(model, p)[groups.pipeline.rank].to(device)
        # The input asks for its gradient so that stage 0's backward does the same work as
        # the others' (which send the input gradient back): equal stages, as the formula has.
        x = torch.randn(self.micro_batch, self.width, device=device, requires_grad=True)
        rows = []
        for schedule in self.schedules:
            for m in self.micro_batches:
                stage = PipelineStage(module, groups.pipeline, schedule, device)
                runs = []
                for repeat in range(self.repeats + 1):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    stage.train([self.micro_batch] * m, lambda i: x,
                                lambda i, y: y.square().sum())
                    module.zero_grad(set_to_none=True)
                    if repeat:  # the first run warms up
                        runs.append(comm.gather((_relative(stage.trace, t0),
                                                 stage.peak_held), root=0))
                if comm.Get_rank() == 0:
                    rows.append(_row(schedule, p, m, runs))
        groups.close()
        return rows


def _relative(trace: list[Traced], t0: float) -> list[Traced]:
    return [Traced(t.action, t.start - t0, t.end - t0, t.cpu) for t in trace]


def _row(schedule: str, p: int, m: int,
         runs: list[list[tuple[list[Traced], int]]]) -> PipelineRow:
    samples: dict[tuple[int, str], list[float]] = {}
    for run in runs:
        for s, (trace, _) in enumerate(run):
            for t in trace:
                samples.setdefault((s, t.action.kind), []).append(t.cpu)
    least = {key: min(values) for key, values in samples.items()}
    modelled, jittered, wall, makespans = [], [], [], []
    for run in runs:
        traces = [trace for trace, _ in run]
        orders = [[t.action for t in trace] for trace in traces]
        own = {(s, t.action): t.cpu for s, trace in enumerate(traces) for t in trace}
        modelled.append(bubble(timeline(orders, lambda s, a: least[(s, a.kind)])))
        jittered.append(bubble(timeline(orders, lambda s, a, own=own: own[(s, a)])))
        begin = min(trace[0].start for trace in traces)
        end = max(trace[-1].end for trace in traces)
        busy = [sum(t.end - t.start for t in trace) for trace in traces]
        wall.append(sum(1 - b / (end - begin) for b in busy) / p)
        makespans.append(end - begin)
    return PipelineRow(schedule, p, m, statistics.median(modelled),
                       statistics.median(jittered), statistics.median(wall),
                       ideal_bubble(p, m), max(held for run in runs for _, held in run),
                       1e3 * statistics.median(makespans),
                       tuple((least[(s, "F")], least[(s, "B")]) for s in range(p)))


def _sleeping_barrier(comm: MPI.Intracomm) -> None:
    """``MPI_Ibarrier`` polled with sleeps, so waiting ranks leave the cores to the others."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def format_rows(rows: list[PipelineRow]) -> str:
    return report.format_table(
        ["schedule", "p", "m", "bubble", "(p-1)/(m+p-1)", "diff", "jittered", "wall",
         "peak held", "step ms"],
        [[r.schedule, str(r.p), str(r.m), f"{r.bubble:.1%}", f"{r.ideal:.1%}",
          f"{100 * (r.bubble - r.ideal):+.1f}p", f"{r.jittered:.1%}", f"{r.wall:.1%}",
          str(r.peak_held), f"{r.step_ms:.1f}"] for r in rows], left=1)


def write_json(path: str, rows: list[PipelineRow], bench: PipelineBench,
               topo: Topology) -> None:
    """The rows and the setup as JSON (:func:`hpctrain.bench.report.write_json`)."""
    report.write_json(path, {"bench": "pipeline", "setup": {
        **asdict(bench), "workers": topo.workers, "cores": available_cores(),
        "backend": topo.backend, "device": str(topo.device)},
        "rows": [asdict(r) for r in rows]})
