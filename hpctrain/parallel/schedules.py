"""Pipeline schedules as pure order tables, and their timeline under given costs.

A schedule says, for stage ``s`` of ``p`` and ``m`` micro-batches, in which order the stage
runs forwards ``F i`` and backwards ``B i``. Dependencies are the pipeline's messages:
``F i`` on stage ``s`` needs ``F i`` of stage ``s - 1`` (its activation), ``B i`` needs
``B i`` of stage ``s + 1`` (its output gradient). :func:`timeline` replays orders under
per-action costs: with unit costs it gives the slot tables of the papers, with measured
costs the bubble that ``hpctrain bench pipeline`` reports.

Both schedules idle ``(p - 1) / (m + p - 1)`` of the time when every stage costs the same;
they differ in memory: GPipe holds all ``m`` micro-batches' activations before its first
backward, 1F1B at most ``p - s`` on stage ``s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "forward_only", "timeline",
           "slot_table", "bubble", "ideal_bubble", "peak_held", "Span"]


@dataclass(frozen=True)
class Action:
    """``F`` (forward) or ``B`` (backward) of micro-batch ``micro``."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def F(i: int) -> Action:  # noqa: N802 - reads like the papers' tables
    return Action("F", i)


def B(i: int) -> Action:  # noqa: N802
    return Action("B", i)


def gpipe(p: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward."""
    return [F(i) for i in range(m)] + [B(i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule)."""
    warmup = min(p - stage - 1, m)
    order = [F(i) for i in range(warmup)]  # warm-up: fill the pipeline
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [F(warmup + i), B(i)]
    order += [B(i) for i in range(m - warmup, m)]  # cool-down: drain the backwards
    return order


def forward_only(p: int, m: int, stage: int) -> list[Action]:
    """Inference: the forwards alone."""
    return [F(i) for i in range(m)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b}


@dataclass(frozen=True)
class Span:
    """One action of one stage on the timeline."""

    action: Action
    start: float
    end: float


def timeline(orders: list[list[Action]],
             cost: Callable[[int, Action], float] = lambda s, a: 1.0) -> list[list[Span]]:
    """When each stage runs each action: as soon as the stage is free and the action's
    message has arrived (communication taken as free). Raises ``ValueError`` when the
    orders deadlock (every stage waits for a message never sent)."""
    p = len(orders)
    done: dict[tuple[int, Action], float] = {}
    spans: list[list[Span]] = [[] for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                action = orders[s][nxt[s]]
                dep = _dependency(s, p, action)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(s, action)] = start + cost(s, action)
                spans[s].append(Span(action, start, free[s]))
                nxt[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: str(orders[s][nxt[s]]) for s in range(p) if nxt[s] < len(orders[s])}
            raise ValueError(f"the orders deadlock; stages wait at {waiting}")
    return spans


def _dependency(stage: int, p: int, action: Action) -> tuple[int, Action] | None:
    if action.kind == "F":
        return (stage - 1, action) if stage > 0 else None
    return (stage + 1, action) if stage < p - 1 else (stage, F(action.micro))


def slot_table(schedule: str, p: int, m: int) -> list[list[str]]:
    """Which action each stage runs in each unit time slot ('' when idle), costs all 1."""
    spans = timeline([SCHEDULES[schedule](p, m, s) for s in range(p)])
    slots = int(max(sp.end for row in spans for sp in row))
    table = [[""] * slots for _ in range(p)]
    for s, row in enumerate(spans):
        for sp in row:
            table[s][int(sp.start)] = str(sp.action)
    return table


def bubble(spans: list[list[Span]]) -> float:
    """Mean over stages of the idle share of the makespan (first start to last end)."""
    begin = min(row[0].start for row in spans)
    end = max(row[-1].end for row in spans)
    busy = [sum(sp.end - sp.start for sp in row) for row in spans]
    return sum(1.0 - b / (end - begin) for b in busy) / len(spans)


def ideal_bubble(p: int, m: int) -> float:
    """``(p - 1) / (m + p - 1)``: the bubble of equal stages."""
    return (p - 1) / (m + p - 1)


def peak_held(order: list[Action]) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward
    not yet)."""
    held = peak = 0
    for action in order:
        held += 1 if action.kind == "F" else -1
        peak = max(peak, held)
    return peak
