"""Enumerate the layouts a job can run on a cluster, predict each, rank them.

The candidates, for ``R`` ranks: tables replicated over ``dp = R`` workers; ``K = 1 ..
min(4, R-1)`` parameter servers in hybrid and full mode, and hybrid with a hot tier; dense
``dp x tp x pp`` grids (``tp, pp`` in 1, 2, 4, ... up to the model's stages) with
micro-batch counts ``pp, 2pp, 4pp`` and both schedules; a smaller gradient bucket where the
dense gradients fill more than one; replicated tables with ZeRO-1 (where the dense optimizer
has state) and ZeRO-2; all-to-all sharded tables (row- and table-wise). Each
candidate is
checked as a job config (:func:`hpctrain.config.load_config` with its overrides) and by
the model (grid, memory), so an infeasible one says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import lru_cache

from hpctrain.config import DataConfig, JobConfig, load_config, local_period
from hpctrain.errors import ConfigError
from hpctrain.plan.cluster import Cluster, probe_reader
from hpctrain.plan.model import F32, Workload, dense_params, predict, workload
from hpctrain.plan.types import Prediction, Proposal

__all__ = ["candidates", "plan", "rank_predictions", "proposal_of", "job_workload",
           "predict_job"]


HOT_FRACTIONS = (0.01, 0.1)


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def candidates(config: JobConfig, ranks: int) -> list[Proposal]:
    """Every layout worth predicting for ``config`` on ``ranks`` ranks (some infeasible),
    each with the job's dense sync model and wire formats (the pipeline's where pp > 1)."""
    keep = {"local_steps": local_period(config.sync.dense),
            "wire_dtype": config.comm.wire_dtype}
    return [dataclasses.replace(p, **keep, pipeline_wire=config.parallel.wire_dtype
                                if p.pp > 1 else "float32") for p in _layouts(config, ranks)]


def _layouts(config: JobConfig, ranks: int) -> list[Proposal]:
    w = workload(config)
    buckets = [config.comm.bucket_kib]
    grads_kib = dense_params(w) * F32 / 1024
    if grads_kib > 2 * 1024 and config.comm.bucket_kib > 1024:
        buckets.append(1024)  # several buckets: reduction starts during backward
    out: list[Proposal] = []
    for bucket in buckets:
        out.append(Proposal(dp=ranks, bucket_kib=bucket))
        if ranks > 1:  # ZeRO-1 when there is optimizer state to shard, ZeRO-2 always
            out += [Proposal(dp=ranks, bucket_kib=bucket, zero=z)
                    for z in ((1, 2) if w.dense_state else (2,))]
        for k in range(1, min(4, ranks - 1) + 1):
            dp = ranks - k
            out += [Proposal("ps", k, "hybrid", dp=dp, bucket_kib=bucket),
                    Proposal("ps", k, "full", dp=dp, bucket_kib=bucket)]
            out += [Proposal("ps", k, "hybrid", hot, dp=dp, bucket_kib=bucket)
                    for hot in HOT_FRACTIONS]
        if ranks > 1:  # over one worker, sharding is the replicated layout
            out += [Proposal("alltoall", sharding=s, dp=ranks, bucket_kib=bucket)
                    for s in ("row_wise", "table_wise")]
    stages = len(config.model.top_mlp) + 1
    for tp in _powers(max(ranks, 1)):
        for pp in _powers(min(stages, max(ranks, 1))):
            if tp * pp == 1 or tp * pp > ranks:
                continue
            dp = max(1, ranks // (tp * pp))
            schedules = ("gpipe", "1f1b") if pp > 1 else ("1f1b",)
            for m in sorted({pp, 2 * pp, 4 * pp}):
                out += [Proposal(dp=dp, tp=tp, pp=pp, micro_batches=m, schedule=s)
                        for s in schedules]
    return out


def _check(config: JobConfig, job: str | None, overrides: Sequence[str], p: Proposal
           ) -> list[str]:
    """Why ``p`` cannot run as a job (its config, its grid); empty when it can."""
    problems: list[str] = []
    try:
        load_config(job, [*overrides, *p.overrides()], env={})
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def rank_predictions(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Runnable feasible layouts fastest first, then predicted-only ones, then infeasible."""
    return sorted(predictions, key=lambda q: (not q.feasible,
                                              -q.samples_per_s, q.peak_memory, q.proposal.name))


def plan(config: JobConfig, cluster: Cluster, job: str | None = None,
         overrides: Sequence[str] = ()) -> list[Prediction]:
    """Predict every candidate layout of ``config`` (loaded from ``job`` and ``overrides``)
    on ``cluster``, ranked."""
    w = job_workload(config, cluster)
    out = []
    for p in candidates(config, cluster.ranks):
        problems = _check(config, job, overrides, p)
        q = predict(w, p, cluster)
        extra = tuple(x for x in problems if x not in q.infeasible)
        out.append(dataclasses.replace(q, infeasible=q.infeasible + extra))
    return rank_predictions(out)


def proposal_of(config: JobConfig, ranks: int) -> Proposal:
    """The layout ``config`` itself asks for on ``ranks`` ranks."""
    par, ps, tier = config.parallel, config.ps, config.tiering
    w = workload(config)
    hot = 0.0
    if tier.budget > 0:
        per_row = w.dim * F32 + w.state_width * F32 + 8
        rows = {"fraction": tier.budget * w.rows, "rows": tier.budget,
                "bytes": tier.budget / per_row}[tier.budget_unit]
        hot = min(1.0, rows / w.rows)
    dense = {"dp": par.dp or max(1, (ranks - ps.servers) // (par.tp * par.pp)),
             "tp": par.tp, "pp": par.pp,
             "micro_batches": par.micro_batches if par.tp * par.pp > 1 else 1,
             "schedule": par.schedule, "bucket_kib": config.comm.bucket_kib,
             "zero": config.train.zero, "local_steps": local_period(config.sync.dense),
             "wire_dtype": config.comm.wire_dtype, "pipeline_wire": par.wire_dtype,
             "stage_cuts": tuple(par.stage_cuts)}
    if config.embeddings.mode == "alltoall":
        return Proposal("alltoall", sharding=config.embeddings.sharding, **dense)
    return Proposal("ps" if ps.servers else "replicated", ps.servers,
                    ps.mode if ps.servers else "hybrid", hot, **dense)


def job_workload(config: JobConfig, cluster: Cluster) -> Workload:
    """The job's sizes with its reader's cost per sample, probed at the micro-batch a
    worker of the replicated layout reads."""
    return workload(config, _read_s(config.data, config.train.batch_size
                                    // cluster.ranks // config.train.accumulate))


@lru_cache(maxsize=8)
def _read_s(data: DataConfig, samples: int) -> float:
    """:func:`probe_reader`, once per process for a data config and batch (``--validate``
    predicts the job's own layout and then plans the rest)."""
    return probe_reader(data, samples)


def predict_job(config: JobConfig, cluster: Cluster) -> Prediction:
    """The model's prediction for the job's own layout."""
    return predict(job_workload(config, cluster), proposal_of(config, cluster.ranks), cluster)
