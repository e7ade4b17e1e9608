"""The formulas of distributed training that users do by hand (``hpctrain plan calc``).

Pure functions, sizes in and numbers out, each returning a flat ``dict`` of named results
(bytes, seconds, fractions) so the CLI prints or dumps them as they are. The definitions
follow the project's background notes: ZeRO (Rajbhandari et al. 2020), the alpha-beta model
of ring and tree allreduce (the same :func:`~hpctrain.comm.ring.ring_cost` the collective
selector uses), Megatron tensor parallelism, the pipeline bubble ``(p-1)/(m+p-1)``, 3D
parallelism, and Young-Daly checkpointing.
"""

from __future__ import annotations

import math

from embeddings.optim import SparseOptimizer
from hpctrain.comm.ring import ring_cost
from hpctrain.errors import ConfigError

__all__ = ["zero", "bubble", "allreduce", "dp_efficiency", "tp_comm", "pipeline_boundary",
           "embedding_memory", "young_daly", "mtbf", "grad_accum", "hybrid"]


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {value:g}")


def _integral(**values: float) -> None:
    for name, value in values.items():
        if value != int(value) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be a whole number >= 1, "
                              f"got {value:g}")


def zero(params: float, stage: int, dp: int, weight_bytes: float = 2.0,
         grad_bytes: float = 2.0, optimizer_bytes: float = 12.0) -> dict[str, float]:
    """Per-rank model state under ZeRO stage 0 (DDP) to 3 over ``dp`` data-parallel ranks:
    stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights. Traffic per
    rank: a ring allreduce of the gradients (``2 (N-1)/N`` of them) for stages 0-2, plus an
    allgather of the weights for stage 3 (``3 (N-1)/N``)."""
    _positive(params=params)
    _integral(dp=dp)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"--stage: ZeRO stages are 0, 1, 2 and 3, got {stage}")
    sharded = [stage >= 3, stage >= 2, stage >= 1]
    parts = [b / dp if s else b for b, s in zip((weight_bytes, grad_bytes, optimizer_bytes),
                                                sharded, strict=True)]
    full = weight_bytes + grad_bytes + optimizer_bytes
    per_param = sum(parts)
    volume = (3.0 if stage == 3 else 2.0) * (dp - 1) / dp
    return {"stage": stage, "dp": dp, "params": params,
            "bytes_per_param_unsharded": full, "bytes_per_param_per_rank": per_param,
            "weights_bytes": parts[0] * params, "gradients_bytes": parts[1] * params,
            "optimizer_bytes": parts[2] * params, "per_rank_bytes": per_param * params,
            "total_bytes": full * params, "reduction": full / per_param,
            "traffic_bytes_per_rank": volume * grad_bytes * params}


def bubble(stages: int, micro_batches: int) -> dict[str, float]:
    """Idle share of a pipeline step, ``(p-1)/(m+p-1)`` for GPipe and 1F1B alike."""
    _integral(stages=stages, micro_batches=micro_batches)
    fraction = (stages - 1) / (micro_batches + stages - 1)
    return {"stages": stages, "micro_batches": micro_batches, "bubble_fraction": fraction,
            "ideal_speedup": stages * (1.0 - fraction)}


def allreduce(nbytes: float, ranks: int, latency: float, bandwidth: float) -> dict[str, float]:
    """Ring ``2(p-1)(alpha + M/p beta)`` and binomial tree ``2 ceil(log2 p)(alpha + M beta)``
    allreduce times of ``nbytes`` over ``ranks`` (reductions not counted)."""
    _positive(bytes=nbytes, latency=latency, bandwidth=bandwidth)
    _integral(ranks=ranks)
    beta = 1.0 / bandwidth
    ring = ring_cost("allreduce", nbytes, ranks, latency, beta, 0.0).seconds
    rounds = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    tree = 2 * rounds * (latency + nbytes * beta)
    return {"bytes": nbytes, "ranks": ranks, "ring_s": ring, "tree_s": tree,
            "ring_bytes_sent_per_rank": 2.0 * (ranks - 1) / ranks * nbytes,
            "tree_bytes_sent_per_rank": 2.0 * rounds * nbytes if ranks > 1 else 0.0,
            "faster": "ring" if ring <= tree else "tree",
            "ring_bus_bandwidth": 2.0 * (ranks - 1) / ranks * nbytes / ring if ring else 0.0}


def dp_efficiency(grad_bytes: float, bandwidth: float, compute_s: float, overlap: float = 0.0,
                  ranks: int = 0) -> dict[str, float]:
    """Scaling efficiency of data parallelism: the ring moves ``2 (N-1)/N`` of the gradients
    per rank (2 when ``ranks`` is 0, the large-N limit); ``overlap`` of the communication (a
    fraction) hides under the compute."""
    _positive(grad_bytes=grad_bytes, bandwidth=bandwidth, compute_ms=compute_s)
    if not 0.0 <= overlap <= 1.0:
        raise ConfigError(f"--overlap: a fraction in [0, 1], got {overlap:g}")
    volume = 2.0 * (ranks - 1) / ranks if ranks else 2.0
    comm = volume * grad_bytes / bandwidth
    exposed = comm - overlap * min(comm, compute_s)
    return {"comm_s": comm, "exposed_comm_s": exposed, "step_s": compute_s + exposed,
            "comm_compute_ratio": comm / compute_s,
            "efficiency": compute_s / (compute_s + exposed)}


def tp_comm(batch: int, seq: int, hidden: int, layers: int, dtype_bytes: float,
            tp: int) -> dict[str, float]:
    """Megatron tensor-parallel traffic of one training step: a column-row pair per attention
    and per MLP block, each one allreduce of the ``B x S x h`` activations forward and one
    backward, so ``4 L`` allreduces; per rank the ring sends ``2 (t-1)/t`` of each."""
    _integral(batch=batch, seq=seq, hidden=hidden, layers=layers, tp=tp)
    _positive(dtype_bytes=dtype_bytes)
    message = batch * seq * hidden * dtype_bytes
    count = 4 * layers
    return {"message_bytes": message, "allreduces_per_step": count,
            "bytes_sent_per_rank": count * 2.0 * (tp - 1) / tp * message,
            "bytes_reduced_per_step": count * message}


def pipeline_boundary(batch: int, seq: int, hidden: int, dtype_bytes: float
                      ) -> dict[str, float]:
    """Bytes crossing one pipeline boundary for a (micro-)batch: the activations forward and
    their gradients backward, ``B x S x h x bytes`` each."""
    _integral(batch=batch, seq=seq, hidden=hidden)
    _positive(dtype_bytes=dtype_bytes)
    message = batch * seq * hidden * dtype_bytes
    return {"forward_bytes": message, "backward_bytes": message, "total_bytes": 2 * message}


def embedding_memory(rows: int, dim: int, dtype_bytes: float,
                     optimizer: str = "sgd") -> dict[str, float]:
    """Bytes of an embedding table and of its sparse optimizer's float32 state (row-wise
    Adagrad one value a row, lazy Adam two moments and a step count: hpctrain's own)."""
    _integral(rows=rows, dim=dim)
    _positive(dtype_bytes=dtype_bytes)
    try:
        width = SparseOptimizer(optimizer).state_width(dim)
    except ValueError as exc:
        raise ConfigError(f"--optimizer: {exc}") from None
    weights, state = rows * dim * dtype_bytes, rows * width * 4.0
    return {"weights_bytes": weights, "optimizer_bytes": state, "total_bytes": weights + state,
            "bytes_per_row": dim * dtype_bytes + width * 4.0}


def mtbf(nodes: int, node_hour_survival: float = 0.0,
         node_mtbf_hours: float = 0.0) -> dict[str, float]:
    """Reliability of ``nodes`` failing independently: from the chance that one node
    survives an hour (the cluster survives an hour with its ``N``-th power), or from a node's
    MTBF (cluster MTBF = node MTBF / N)."""
    _integral(nodes=nodes)
    if node_mtbf_hours:
        _positive(node_mtbf_hours=node_mtbf_hours)
        hours = node_mtbf_hours / nodes
        return {"cluster_mtbf_hours": hours,
                "cluster_failure_per_hour": 1.0 - math.exp(-1.0 / hours)}
    if not 0.0 < node_hour_survival < 1.0:
        raise ConfigError(f"--node-hour-survival: a probability in (0, 1), got "
                          f"{node_hour_survival:g} (or give --node-mtbf-hours)")
    survive = node_hour_survival ** nodes
    return {"cluster_failure_per_hour": 1.0 - survive,
            "cluster_mtbf_hours": -1.0 / math.log(survive)}


def young_daly(write_s: float, mtbf_s: float) -> dict[str, float]:
    """Young-Daly checkpoint interval ``sqrt(2 x write x MTBF)`` and its overhead: the
    writes (``write / tau``) plus the work lost to a failure on average (``tau / 2 MTBF``)."""
    _positive(write_minutes=write_s, mtbf_hours=mtbf_s)
    tau = math.sqrt(2.0 * write_s * mtbf_s)
    return {"mtbf_hours": mtbf_s / 3600.0, "interval_minutes": tau / 60.0,
            "write_overhead": write_s / tau, "rework_overhead": tau / (2.0 * mtbf_s),
            "overhead": write_s / tau + tau / (2.0 * mtbf_s)}


def grad_accum(comm_s: float, steps: int, compute_s: float) -> dict[str, float]:
    """Synchronisation overhead with gradient accumulation: one allreduce per ``steps``
    micro-steps of ``compute_s`` each."""
    _positive(comm_ms=comm_s, compute_ms=compute_s)
    _integral(steps=steps)
    return {"overhead": comm_s / (steps * compute_s),
            "overhead_without_accumulation": comm_s / compute_s,
            "syncs_saved_factor": steps}


def hybrid(params: float, tp: int, pp: int, dp: int, micro_batches: int = 0,
           bytes_per_param: float = 16.0, grad_bytes: float = 2.0) -> dict[str, float]:
    """3D parallelism ``N = dp x pp x tp``: each rank holds ``1/(tp pp)`` of the model, so its
    model state and the gradients its data-parallel allreduce carries shrink by that factor;
    with ``micro_batches`` the pipeline bubble too."""
    _positive(params=params)
    _integral(tp=tp, pp=pp, dp=dp)
    shard = params / (tp * pp)
    out = {"ranks": tp * pp * dp, "params_per_rank": shard,
           "memory_bytes_per_rank": shard * bytes_per_param,
           "dp_allreduce_bytes_per_rank": shard * grad_bytes,
           "dp_ring_bytes_sent_per_rank": 2.0 * (dp - 1) / dp * shard * grad_bytes}
    if micro_batches:
        out["bubble_fraction"] = bubble(pp, micro_batches)["bubble_fraction"]
    return out
