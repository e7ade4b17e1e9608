"""The planner's model: per-rank memory and step time of a :class:`~.types.Proposal`.

Pure functions of the job's sizes (:class:`Workload`) and the :class:`~.cluster.Cluster`.
What a step costs, per rank:

- reading: the job's own reader's seconds per sample (probed, :class:`Workload`);
- dense compute: ``3 x 2 x MACs`` FLOPs (forward, and a backward twice as dear) at a share
  (:data:`MATMUL_EFFICIENCY`) of the probed matmul rate, :data:`ACTIVATION_PASSES` memory
  passes over the activations at the probed copy bandwidth, and a fixed cost in units of
  the probed op latency (per layer, per step and per micro-batch), stretched by the core
  share when ranks outnumber cores;
- embeddings: the de-duplication and memory passes over the step's looked-up ids and rows;
  per unique row (expected distinct draws of the job's Zipf ids) an update costing a few
  probed de-duplication ids (:data:`ROW_UPDATE_IDS`); replicated tables all-gather the
  touched rows (ring allgather cost), parameter servers add a pull and a push per server on
  the link the ranks share (intra-node on one node, inter-node otherwise) and the server's
  own apply time; a hot tier serves the share of lookups its top rows cover and sums its
  gradients over the workers; sharded (all-to-all) tables exchange the remote rows at the
  calibrated alltoallv cost and their owners apply them;
- the guard (every step): the non-finite check and scaling of the dense gradients and the
  step's statistics; the dense optimizer's passes over the parameters and its state;
- dense gradients: one allreduce per bucket over the data-parallel ranks, priced by the
  collective selector's own cost model (:func:`hpctrain.comm.select.ranking`), hidden under
  the backward pass when more than one bucket lets it start early; ZeRO-1 adds the
  allgather of the updated parameters, ZeRO-2 reduce-scatters a bucket per weight (and one
  for the small parameters) inline from the gradient hook, so none of it is hidden; a
  16-bit ``comm.wire_dtype`` halves the bytes, local SGD (``local:H``) averages the
  parameters (the same bytes) every H steps, after the step;
- tensor and pipeline parallelism: an allreduce of the activations per column/row pair each
  way, the boundary activations and their gradients point to point per micro-batch (16-bit
  with ``parallel.wire_dtype``), and the bubble ``(p-1)/(m+p-1)``.

Memory per rank is the runtime's base (probed) plus weights, gradients and optimizer state
(ZeRO: the state over the data-parallel ranks; ZeRO-2: the gradient too, plus at most its
staging buffer, 1/16 of a bucket or shard),
activations held for backward (all micro-batches for GPipe, ``min(m, p)`` for 1F1B), table
rows with their optimizer state, the hot tier with its lookup counters, message buffers and
the batch. Ignored: allocator slack and fragmentation, evaluation, checkpoints,
stragglers, and the skew of real (non-Zipf) id streams. The constants named below were
fitted to the phases the trainer measures, on this project's 2-core machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from embeddings.optim import SparseOptimizer
from hpctrain.comm.ring import ring_cost
from hpctrain.comm.select import ranking
from hpctrain.comm.types import DTYPES, Layout, Link, Request
from hpctrain.config import NUM_DENSE, JobConfig
from hpctrain.errors import ConfigError
from hpctrain.models.dlrm import interaction_width
from hpctrain.plan.cluster import Cluster
from hpctrain.plan.types import Prediction, Proposal, RankPrediction
from hpctrain.runtime.topology import make_grid
from hpctrain.train.dense_grid import top_cuts

__all__ = ["Workload", "workload", "dense_params", "zipf_unique", "zipf_coverage",
           "allreduce_s", "predict", "OPS_PER_LAYER"]

F32 = 4
ID_BYTES = 8
OPS_PER_LAYER = 14
"""Framework ops of one linear layer per step: forward matmul and activation, backward
input and weight gradients, bias sum, activation gradient, optimizer update (autograd and
hook dispatch included), as counted by the profiler on the DLRM step."""
OPS_FIXED = 540
"""The rest of a step in units of the probed op latency (a tiny op outside autograd): the
interaction, loss, metrics, autograd's graph and engine, the step's bookkeeping."""
OPS_STAGE = 10  # a later pipeline stage's own bookkeeping
OPS_PER_TABLE = 3  # a table's lookup: id remap, gather, its slice of the interaction input
MATMUL_EFFICIENCY = 0.9
"""Share of the probed 512^3 matmul rate the step's matmuls sustain."""
ACTIVATION_PASSES = 16
"""Memory passes over the activations per step (forward, backward, the elementwise ops
between the matmuls); with the two constants above, fitted to the compute phase of 14
one-rank runs (the jobs of ``jobs/configs`` at batch 32-2048, dims 16 and 64) within 11%,
the passes then rescaled to the 8 MiB copy the probe now times."""
ID_PASSES = 2.3  # per looked-up id: the de-duplication, the inverse, the remap
LOOKUP_PASSES = 2.7  # memory passes over the looked-up rows: gather, gradient, remap
ROW_UPDATE_IDS = 11.0
"""Cost of applying one touched row, in units of the probed per-id de-duplication cost
(``device.id_latency``): a cache miss into a large table, the coalesce and the update
(fitted to the push phase, with :data:`STATE_ROW_IDS` more for a row with optimizer
state). This and the other per-id constants were multiplied by 1.9 (``ID_PASSES``: its
non-de-duplication part) when the de-duplication became 1.9x faster (a radix sort of every
id in place of a hash table): the probe's unit shrank, the work they price did not."""
STATE_ROW_IDS = 3.2
OPT_PASSES = 3.7  # memory passes of the dense optimizer over the parameters
OPT_STATE_PASSES = 16  # more per float of optimizer state per parameter (Adagrad's sqrt, div)
OPT_OPS = 46  # the dense optimizer's fixed cost (its foreach calls), in op latencies
GUARD_PASSES = 2.7  # the non-finite check and the scaling over the dense gradients, every step
GUARD_OPS = 120  # the step's statistics and the guard's fixed cost, in op latencies
GUARD_ID_PASSES = 0.32  # its scan of the looked-up rows' gradients, per id
ZERO2_STALL = 0.1
"""ZeRO-2's reductions run inline from the gradient hook, so backward waits at each bucket
for the slowest rank's gradient: measured, 10% of the compute at 2 ranks (dlrm_reference
at batch 128 and 2048, default, criteo_sample), plus :data:`ZERO2_BUCKET_OPS` op latencies
a bucket for the hook and the call."""
ZERO2_BUCKET_OPS = 60
TP_CALL_OPS = 330
"""A tensor-parallel allreduce's cost beyond its bytes, in op latencies: the autograd
function and the wait for the other ranks of the group at every call (measured at 2 ranks,
tp 2: 250-350 us a call on default, dlrm_reference and dlrm_reference_2048)."""
READ_COLD = 1.15
"""Reading inside a step costs more than the probe's back-to-back reads (the compute has
filled the caches between reads), plus :data:`READ_OPS` op latencies a read for slicing
the worker's share and the batch's objects: measured on 9 one-rank runs within 10%."""
READ_OPS = 120
RUNTIME_MEMORY = 28 * 2**20
"""Resident memory a running rank holds beyond the probed base and the job's tensors (its
threads' malloc arenas, MPI's buffers, the trainer's objects): a training run of
``jobs/configs/criteo_sample.toml``, whose tensors are a few MiB, peaked 27-30 MiB above
the probe."""


@dataclass(frozen=True)
class Workload:
    """The sizes of a job that the model reads."""

    table_sizes: tuple[int, ...]
    dim: int
    bottom: tuple[int, ...]  # layer widths including the 13 inputs
    top: tuple[int, ...]  # layer widths including the interaction input
    batch: int
    optimizer: str  # the dense one (train.optimizer)
    zipf: float
    accumulate: int
    prefetch: bool
    table_optimizer: str
    """The tables' optimizer (``train.sparse_optimizer`` resolved)."""
    momentum: float
    read_s: float = 0.0
    """Seconds to read one sample with the job's reader (:func:`~.cluster.probe_reader`;
    0 leaves reading out)."""

    @property
    def tables(self) -> int:
        return len(self.table_sizes)

    @property
    def rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def state_width(self) -> int:
        """float32 optimizer values per table row (hpctrain's sparse optimizers)."""
        return SparseOptimizer(self.table_optimizer).state_width(self.dim)

    @property
    def dense_state(self) -> int:
        """float32 optimizer values per dense parameter (hpctrain.train.optim): Adagrad's
        sum of squares, a momentum buffer, or Adam's two moments."""
        if self.optimizer in ("adam", "adamw", "lamb"):
            return 2
        return 1 if self.optimizer == "adagrad" or self.momentum else 0

    @property
    def table_dense_state(self) -> float:
        """float32 optimizer values per dense parameter on the servers in full mode (the
        dense table's per-value optimizer: Adagrad's accumulator and round sum, Adam's
        moments and a step count per row). The servers run no other optimizer, and the
        config check refuses such a layout, so it counts none."""
        if self.optimizer not in ("sgd", "adagrad", "adam"):
            return 0.0
        kind = {"adagrad": "adagrad_values"}.get(self.optimizer, self.optimizer)
        return SparseOptimizer(kind).state_width(self.dim) / self.dim


def workload(config: JobConfig, read_s: float = 0.0) -> Workload:
    """The :class:`Workload` of a job config, reading a sample in ``read_s`` seconds."""
    m = config.model
    sizes = tuple(config.data.table_sizes)
    return Workload(sizes, m.embedding_dim, (NUM_DENSE, *m.bottom_mlp),
                    (interaction_width(len(sizes), m.embedding_dim), *m.top_mlp),
                    config.train.batch_size, config.train.optimizer, config.data.zipf,
                    config.train.accumulate, config.ps.prefetch, config.train.table_optimizer,
                    config.train.momentum, read_s)


def _linear_params(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=True))


def dense_params(w: Workload) -> int:
    """Parameters of :class:`~hpctrain.models.dlrm.DLRM` (bottom and top MLP)."""
    return _linear_params(w.bottom) + _linear_params(w.top)


def _bins(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank bins ``[lo, hi)`` covering ``range(n)``: exact below 256, geometric above."""
    edges = np.unique(np.concatenate([np.arange(min(n, 256) + 1),
                                      np.geomspace(256, n, 200).astype(np.int64)
                                      if n > 256 else np.array([], np.int64), [n]]))
    return edges[:-1], edges[1:]


def _zipf_cdf(x: np.ndarray, n: int, s: float) -> np.ndarray:
    """P(rank < x) of the synthetic generator's continuous inverse-CDF Zipf draw."""
    x = np.asarray(x, dtype=np.float64) + 1.0
    if abs(s - 1.0) < 1e-9:
        return np.log(x) / math.log(n + 1.0)
    return (x ** (1.0 - s) - 1.0) / ((n + 1.0) ** (1.0 - s) - 1.0)


@lru_cache(maxsize=4096)
def zipf_unique(n: int, s: float, draws: float) -> float:
    """Expected distinct rows among ``draws`` Zipf(``s``) ids over ``n`` rows."""
    if draws <= 0:
        return 0.0
    lo, hi = _bins(n)
    p = (_zipf_cdf(hi, n, s) - _zipf_cdf(lo, n, s)) / (hi - lo)
    return float(np.sum((hi - lo) * -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-15)))))


def zipf_coverage(n: int, s: float, top: float) -> float:
    """Share of Zipf lookups that fall on the ``top`` most frequent rows."""
    return float(_zipf_cdf(np.array([min(top, n)]), n, s)[0])


def allreduce_s(nbytes: float, ranks: int, cluster: Cluster, span_nodes: bool) -> float:
    """Cheapest allreduce of ``nbytes`` float32 over ``ranks`` by the selector's model."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    nodes = cluster.nodes if span_nodes and ranks > cluster.ranks_per_node else 1
    per_node = math.ceil(ranks / nodes)
    layout = Layout(ranks, 0, per_node, 0, nodes, ranks == per_node * nodes,
                    cluster.oversubscribed)
    req = Request("allreduce", max(1, int(nbytes // F32)), DTYPES["float32"])
    return min(cost.seconds for _, cost in ranking(req, layout, cluster.comm))


def _allgather_s(nbytes_per_rank: float, ranks: int, link: Link) -> float:
    if ranks <= 1:
        return 0.0
    return ring_cost("allgather", nbytes_per_rank * ranks, ranks, link.alpha, link.beta,
                     0.0).seconds


def _link(cluster: Cluster, ranks: int) -> Link:
    return cluster.comm.net if ranks > cluster.ranks_per_node else cluster.comm.p2p


def _unique_rows(w: Workload, samples: float) -> float:
    return sum(zipf_unique(n, w.zipf, samples) for n in w.table_sizes)


def predict(w: Workload, p: Proposal, cluster: Cluster) -> Prediction:
    """Memory and step time of every kind of rank under ``p``; ``infeasible`` says why it
    cannot run on ``cluster`` (grid, memory)."""
    dev, share = cluster.device, cluster.core_share
    problems: list[str] = []
    workers = p.dp * p.tp * p.pp
    try:
        make_grid(cluster.ranks - p.servers, p.tp, p.pp)
        make_grid(cluster.ranks - p.servers, p.tp, p.pp, p.dp)
    except ConfigError as exc:
        problems.append(str(exc))
    local = w.batch / p.dp  # samples per data-parallel replica per optimizer step
    micro = local / p.micro_batches if p.tp * p.pp > 1 else local / w.accumulate
    chunks = p.micro_batches if p.tp * p.pp > 1 else w.accumulate
    params = dense_params(w)
    flops_rate = dev.flops * MATMUL_EFFICIENCY * share
    op_s = dev.op_latency / share
    bw = dev.memory_bandwidth * share
    span = cluster.nodes > 1

    # --- embeddings on the worker that looks them up (stage 0)
    lookups = local * w.tables
    unique = _unique_rows(w, local)
    row_bytes = w.dim * F32
    state_bytes = w.state_width * F32
    emb_mem: dict[str, float] = {}
    row_apply = (ROW_UPDATE_IDS + STATE_ROW_IDS * (w.state_width > 0)) * dev.id_latency / share
    emb_time: dict[str, float] = {"data": READ_COLD * w.read_s * local / share
                                  + op_s * READ_OPS * chunks,
                                  "lookup": op_s * OPS_PER_TABLE * w.tables * chunks
                                  + ID_PASSES * lookups * dev.id_latency / share
                                  + LOOKUP_PASSES * lookups * row_bytes / bw}
    inb = outb = 0.0
    server: RankPrediction | None = None
    if p.embeddings == "replicated":
        emb_mem["tables"] = w.rows * (row_bytes + state_bytes)
        gathered = unique * (ID_BYTES + row_bytes)
        emb_mem["comm_buffers"] = gathered * (p.dp + 1)
        # every replica applies every worker's rows, having unpacked the others'
        emb_time["push"] = (_allgather_s(gathered, p.dp, _link(cluster, workers))
                            + (2 * p.dp - 1) * unique * row_apply)
        inb += gathered * (p.dp - 1)
        outb += gathered * (p.dp - 1)
    elif p.embeddings == "ps":
        hot_rows = p.hot_fraction * w.rows
        if hot_rows:
            # the cold tail's distinct rows: all distinct rows less the hot ones touched
            hot_touched = sum(zipf_unique(min(n, math.ceil(p.hot_fraction * n)), w.zipf,
                                          local * zipf_coverage(n, w.zipf, p.hot_fraction * n))
                              for n in w.table_sizes)
            cold = max(unique - hot_touched, 0.0)
            emb_mem["hot_tier"] = hot_rows * (row_bytes + state_bytes + ID_BYTES)
            emb_mem["lookup_counts"] = F32 * w.rows
            block = 2 * hot_rows * (w.dim + 1) * F32 * (p.dp - 1) / max(p.dp, 1)
            sparse = hot_touched * p.dp * (w.dim + 2) * F32 * (p.dp - 1) / max(p.dp, 1)
            emb_time["hot_sync"] = (allreduce_s(hot_rows * (w.dim + 1) * F32, p.dp, cluster,
                                                span) if block <= 4 * sparse else
                                    _allgather_s(hot_touched * (w.dim + 2) * F32, p.dp,
                                                 _link(cluster, workers)))
            emb_time["hot_apply"] = p.dp * hot_touched * row_apply
        else:
            cold = unique
        link = cluster.comm.p2p if cluster.nodes == 1 else cluster.comm.net
        # full mode: the dense parameters travel as one more table, every step
        dense_rows = params if p.ps_mode == "full" else 0
        pull_in = cold * row_bytes + dense_rows * F32
        pull_out = cold * ID_BYTES
        push_out = cold * (ID_BYTES + row_bytes) + dense_rows * F32
        messages = 3 * p.servers  # request + reply per server, one push per server
        oversub = cluster.comm.oversubscribed if cluster.oversubscribed else 1.0
        wire = messages * link.alpha * oversub + (pull_in + pull_out + push_out) * link.beta
        server_rows = p.dp * (cold + dense_rows / max(w.dim, 1)) / p.servers
        serve = server_rows * row_apply + \
            3 * p.dp * op_s * OPS_PER_TABLE
        pull_share = pull_in / max(pull_in + push_out, 1.0)
        emb_time["pull"] = wire * pull_share
        emb_time["push"] = wire * (1 - pull_share)
        emb_time["server_wait"] = max(0.0, serve - wire)
        emb_mem["comm_buffers"] = 2 * (pull_in + push_out)
        inb += pull_in
        outb += pull_out + push_out
        stored = w.rows / p.servers
        dense_state = (params / p.servers * (1 + w.table_dense_state) * F32 if dense_rows
                       else 0.0)
        server = RankPrediction(
            "server", p.servers,
            {"base": cluster.base_memory, "runtime": RUNTIME_MEMORY,
             "table_shards": stored * (row_bytes + state_bytes), "routing": stored * ID_BYTES,
             "dense_shard": dense_state,
             "comm_buffers": 2 * p.dp * (pull_in + push_out) / p.servers},
            {"serve": serve}, p.dp * (pull_out + push_out) / p.servers,
            p.dp * pull_in / p.servers)
    else:  # all-to-all sharded tables: each worker owns 1/dp of the rows
        emb_mem["table_shards"] = w.rows * (row_bytes + state_bytes) / p.dp
        # a worker's unique rows held elsewhere: ids and values one way, gradients back
        remote = unique * (p.dp - 1) / p.dp
        exchanged = remote * (ID_BYTES + row_bytes)
        # three exchanges a step (the counts, the gradients with the next ids, the next
        # values), priced by the toolkit's calibrated alltoallv costs: one shared-memory
        # exchange inside a node, pairwise rounds over the network across nodes
        if p.dp == 1:
            wire = 0.0
        elif workers <= cluster.ranks_per_node:
            ex = cluster.comm.exchange_shm
            wire = 3 * ex.alpha + 2 * exchanged * ex.beta
        else:
            wire = 3 * (p.dp - 1) * max(cluster.comm.exchange_p2p.alpha, cluster.comm.net.alpha) \
                + 2 * exchanged * cluster.comm.net.beta
        # the owner applies the rows it owns; each remote row is packed and unpacked twice
        # (its gradient to the owner, the next lookup's value back, which rides in the push)
        emb_time["push"] = wire + (unique + 4 * remote) * row_apply
        emb_mem["comm_buffers"] = 4 * exchanged
        inb += 2 * exchanged
        outb += 2 * exchanged

    # --- dense part, per stage
    stages = _stage_layers(w, p.pp, p.stage_cuts)
    bucket = p.bucket_kib * 1024
    stage_preds: list[RankPrediction] = []
    in_flight = p.micro_batches if p.schedule == "gpipe" else min(p.micro_batches, p.pp)
    in_flight = in_flight if p.tp * p.pp > 1 else 1
    worst = 0.0
    for s, st in enumerate(stages):
        stage_params = st.params(p.tp)
        held = st.activations + (w.tables * w.dim if s == 0 else 0)  # floats per sample
        compute = 3 * 2 * st.macs_per_rank(p.tp) * local / flops_rate + \
            ACTIVATION_PASSES * held * local * F32 / bw + \
            op_s * (OPS_PER_LAYER * st.layers + (OPS_FIXED if s == 0 else OPS_STAGE)) * chunks
        grads = stage_params * F32
        # ZeRO-2: a bucket per weight, the small parameters one more (sharded.cut)
        nbuckets = st.layers + 1 if p.zero == 2 else max(1, math.ceil(grads / bucket))
        wire = 0.5 if p.wire_dtype != "float32" else 1.0  # 16-bit messages, half the bytes
        sync = allreduce_s(grads * wire, p.dp, cluster, span) if p.ps_mode != "full" or \
            p.embeddings != "ps" else 0.0
        sync += (nbuckets - 1) * cluster.comm.p2p.alpha * math.ceil(math.log2(max(p.dp, 2)))
        if p.zero == 2 and p.dp > 1:  # each inline reduction holds backward up
            sync += ZERO2_STALL * compute + nbuckets * op_s * ZERO2_BUCKET_OPS
        if p.zero == 1:  # the updated chunks allgathered (ZeRO-2's allgather is in the
            sync += _allgather_s(grads / p.dp, p.dp, _link(cluster, workers))  # allreduce's)
        # ZeRO-2 reduce-scatters inline, from the gradient hook: nothing hidden; local SGD
        # averages the parameters every H steps, after the step (nothing hidden either)
        if p.local_steps:
            sync, hidden = sync / p.local_steps, 0.0
        else:
            hidden = 0.0 if p.zero == 2 else min(sync, 2 / 3 * compute) * (1 - 1 / nbuckets)
        owned = 1 / p.dp if p.zero else 1.0  # the share of the optimizer state kept
        opt = op_s * OPT_OPS + (OPT_PASSES + OPT_STATE_PASSES * w.dense_state) * \
            grads * owned / bw
        guard = op_s * GUARD_OPS + GUARD_PASSES * grads / bw + \
            (GUARD_ID_PASSES * lookups * dev.id_latency / share if s == 0 else 0.0)
        t: dict[str, float] = {"compute": compute, "dense_sync": sync - hidden,
                               "guard": guard, "optimizer": opt}
        sin = sout = 0.0
        if p.tp > 1 and st.tp_widths:
            t["tp_allreduce"] = 2 * chunks * sum(
                allreduce_s(micro * width * F32, p.tp, cluster, False) + op_s * TP_CALL_OPS
                for width in st.tp_widths)
            tp_bytes = 2 * local * sum(st.tp_widths) * F32 * 2 * (p.tp - 1) / p.tp
            sin += tp_bytes
            sout += tp_bytes
        if p.pp > 1:
            link = cluster.comm.p2p if p.pp * p.tp <= cluster.ranks_per_node else \
                cluster.comm.net
            hops = (s > 0) + (s < p.pp - 1)
            msg = micro * st.boundary * (2 if p.pipeline_wire != "float32" else F32)
            t["pipeline_p2p"] = hops * 2 * chunks * (link.alpha + msg * link.beta)
            sin += hops * chunks * msg
            sout += hops * chunks * msg
        mem = {"base": cluster.base_memory, "runtime": RUNTIME_MEMORY,
               "weights": stage_params * F32,
               "gradients": (grads / p.dp + min(bucket, grads / p.dp) / 16 if p.zero == 2
                             else grads),  # ZeRO-2: the shard and at most the staging buffer
               "optimizer_state": stage_params * w.dense_state * F32 * owned,
               "activations": 2 * st.activations * micro * F32 * in_flight,
               "batch": local * (NUM_DENSE * F32 + w.tables * ID_BYTES + F32) if s == 0
               else 0.0}
        if s == 0:
            mem.update(emb_mem)
            mem["activations"] += 2 * local * w.tables * w.dim * F32 / chunks * in_flight
            t.update(emb_time)
            if p.embeddings == "ps" and w.prefetch:  # the next pull overlaps this step
                t["pull"] = max(0.0, t["pull"] - compute)
            sin += inb
            sout += outb
        stage_preds.append(RankPrediction(
            "worker" if p.pp == 1 else f"stage {s}", p.dp * p.tp, mem, t, sin, sout))
        worst = max(worst, sum(t.values()))
    if p.pp > 1:
        frac = (p.pp - 1) / (p.micro_batches + p.pp - 1)
        step = worst / (1 - frac)  # every stage idles the bubble share of the step
        stage_preds = [RankPrediction(r.role, r.count, r.memory,
                                      {**r.time_s, "bubble": step - r.step_s},
                                      r.input_bytes, r.output_bytes) for r in stage_preds]
    else:
        step = worst
    if server is not None:
        step = max(step, server.step_s)
    ranks = tuple(stage_preds) + ((server,) if server else ())
    peak = max(r.memory_bytes for r in ranks)
    for r in ranks:
        if r.memory_bytes > cluster.memory_per_rank:
            problems.append(f"{r.role} memory {r.memory_bytes / 2**20:,.0f} MiB is over the "
                            f"{cluster.memory_per_rank / 2**20:,.0f} MiB per rank by "
                            f"{(r.memory_bytes - cluster.memory_per_rank) / 2**20:,.0f} MiB")
    notes = ("ranks share cores",) if cluster.oversubscribed else ()
    return Prediction(p, ranks, step, w.batch / step if step else 0.0, peak, tuple(problems),
                      notes)


def _tp_split(widths: tuple[int, ...]) -> tuple[int, int, list[int]]:
    """An MLP under :func:`~hpctrain.parallel.layers.tensor_parallel_mlp`: parameters in
    column/row pairs (sharded), in a last unpaired layer (replicated), and the output width
    of each pair's row layer (one allreduce each way)."""
    layers = len(widths) - 1
    paired = layers - layers % 2
    return (_linear_params(widths[:paired + 1]), _linear_params(widths[paired:]),
            [widths[k + 2] for k in range(0, paired, 2)])


@dataclass(frozen=True)
class _Stage:
    layers: int
    sharded: int  # parameters split over the tensor-parallel ranks
    replicated: int  # parameters every tensor-parallel rank holds whole
    macs: float  # multiply-adds per sample (the whole stage)
    activations: int  # floats per sample held for backward
    boundary: int  # width of the activations sent to the next stage
    tp_widths: tuple[int, ...]  # widths of its tensor-parallel allreduces

    def params(self, tp: int) -> float:
        return self.sharded / tp + self.replicated

    def macs_per_rank(self, tp: int) -> float:
        """Linear layers' share (one MAC per weight) plus the interaction, done whole."""
        return self.params(tp) + self.macs - self.sharded - self.replicated


def _stage_layers(w: Workload, pp: int, stage_cuts: tuple[int, ...]) -> list[_Stage]:
    """The pipeline stages: stage 0 holds the bottom MLP, the interaction and the first top
    layers, cut where the trainer cuts (``stage_cuts``, or balanced when empty)."""
    top_layers = len(w.top) - 1
    features = w.tables + 1
    cuts = [0, *top_cuts(top_layers, pp, stage_cuts), top_layers]
    out = []
    for s in range(pp):
        lo, hi = cuts[s], cuts[s + 1]
        mlps = [w.top[lo:hi + 1]] if hi > lo else []
        extra_macs, acts = 0.0, sum(w.top[lo + 1:hi + 1])
        if s == 0:
            mlps.append(w.bottom)
            extra_macs = features * features * w.dim
            acts += sum(w.bottom[1:]) + features * features + w.top[0]
        split = [_tp_split(m) for m in mlps]
        sharded = sum(x[0] for x in split)
        replicated = sum(x[1] for x in split)
        out.append(_Stage(sum(len(m) - 1 for m in mlps), sharded, replicated,
                          sharded + replicated + extra_macs, acts, w.top[hi],
                          tuple(width for x in split for width in x[2])))
    return out
