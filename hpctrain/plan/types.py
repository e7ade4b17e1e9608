"""Value types of the planner: a proposed layout, and what the model predicts for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.config import ParallelConfig

__all__ = ["Proposal", "RankPrediction", "Prediction"]


@dataclass(frozen=True)
class Proposal:
    """One way to run the job: where the tables live and how the dense model is split.

    ``embeddings`` is ``replicated`` (every worker holds every row), ``ps`` (``servers``
    parameter-server ranks, ``ps_mode`` hybrid or full, a hot tier of ``hot_fraction`` of
    the rows when > 0) or ``alltoall`` (tables sharded over the workers by ``sharding``,
    rows exchanged by all-to-all; predicted only where this build lacks it).
    """

    embeddings: str = "replicated"
    servers: int = 0
    ps_mode: str = "hybrid"
    hot_fraction: float = 0.0
    sharding: str = ""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    bucket_kib: int = 25600
    zero: int = 0  # train.zero: the dense optimizer state (1) and gradients (2) sharded
    local_steps: int = 0  # sync.dense = local:H (0: bsp, a gradient reduction every step)
    wire_dtype: str = "float32"  # comm.wire_dtype: the dense gradient reduction's messages
    pipeline_wire: str = "float32"  # parallel.wire_dtype: the pipeline's messages (pp > 1)
    stage_cuts: tuple[int, ...] = ()  # parallel.stage_cuts (pp - 1 of them; empty: balanced)

    @property
    def name(self) -> str:
        if self.embeddings == "ps":
            tables = f"ps{self.servers}-{self.ps_mode}"
            if self.hot_fraction:
                tables += f"-hot{self.hot_fraction:g}"
        elif self.embeddings == "alltoall":
            tables = f"a2a-{self.sharding}"
        else:
            tables = "replicated"
        grid = f"dp{self.dp}"
        if self.tp * self.pp > 1:
            grid += f"xtp{self.tp}xpp{self.pp}-m{self.micro_batches}"
            if self.pp > 1:
                grid += f"-{self.schedule}"
            if self.stage_cuts:
                grid += f"-cuts{'_'.join(map(str, self.stage_cuts))}"
        name = f"{tables}/{grid}/b{self.bucket_kib // 1024}MiB"
        if self.zero:
            name += f"/zero{self.zero}"
        if self.local_steps:
            name += f"/local{self.local_steps}"
        if self.wire_dtype != "float32":
            name += f"/{self.wire_dtype}"
        if self.pipeline_wire != "float32":
            name += f"/pp-{self.pipeline_wire}"
        return name

    def overrides(self) -> list[str]:
        """``--set`` keys that run this layout (:func:`hpctrain.config.load_config`)."""
        # without tp/pp the defaults: micro-batches and a schedule set there are unused keys
        grid = self if self.tp * self.pp > 1 else ParallelConfig()
        keys = [f"ps.servers={self.servers}", f"parallel.tp={self.tp}",
                f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                f"parallel.micro_batches={grid.micro_batches}",
                f"parallel.schedule='{grid.schedule}'",
                f"parallel.stage_cuts={list(self.stage_cuts)}",
                f"comm.bucket_kib={self.bucket_kib}",
                f"train.zero={self.zero}", f"comm.wire_dtype='{self.wire_dtype}'",
                f"parallel.wire_dtype='{self.pipeline_wire}'",
                f"sync.dense='{f'local:{self.local_steps}' if self.local_steps else 'bsp'}'"]
        keys += [f"tiering.budget={self.hot_fraction}", "tiering.budget_unit='fraction'"]
        # also without servers: a full-mode job's ps.mode = 'full' stops a server-less layout,
        # as an ssp_lr = 'sqrt' does (it scales by the servers' staleness bound)
        keys.append(f"ps.mode='{self.ps_mode}'")
        if not self.servers:
            keys.append("sync.ssp_lr='constant'")
        # always: a job's own embeddings.mode ('alltoall', 'replicated', 'ps') would
        # otherwise run another layout than this one's, or stop it
        if self.embeddings == "alltoall":
            keys += ["embeddings.mode='alltoall'", f"embeddings.sharding='{self.sharding}'"]
        else:
            keys.append(f"embeddings.mode='{'ps' if self.servers else 'replicated'}'")
        return keys


@dataclass(frozen=True)
class RankPrediction:
    """One kind of rank (a worker, a server, a pipeline stage): its memory by part, its
    step time by phase, and the bytes it sends and receives per step."""

    role: str
    count: int
    memory: dict[str, float]
    time_s: dict[str, float]
    input_bytes: float
    output_bytes: float

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def step_s(self) -> float:
        return sum(self.time_s.values())


@dataclass(frozen=True)
class Prediction:
    """The model's verdict on a :class:`Proposal`."""

    proposal: Proposal
    ranks: tuple[RankPrediction, ...]
    step_s: float
    samples_per_s: float
    peak_memory: float
    infeasible: tuple[str, ...] = ()  # why it cannot run here (memory, grid)
    notes: tuple[str, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return not self.infeasible
