"""A per-rank timeline of where a run's time goes, written as Chrome trace / Perfetto JSON.

``runtime.trace = PATH`` turns it on: :func:`start` (collective over the world) aligns the
ranks' clocks at a barrier; code marks intervals with ``with span("name", step=k):`` or, for
an interval whose ends are seen in different places (a gradient bucket's reduction, from
launch to completion), :func:`record` with both times; :func:`finish` (collective) gathers
every rank's spans to world rank 0, which writes one file: one process per rank (``pid`` =
world rank), one track per thread (``tid``), each span a complete event (``ph: "X"``). Open
it in https://ui.perfetto.dev or chrome://tracing; ``hpctrain trace summarize`` reads it.

Off (the default), :func:`span` returns one shared object whose enter and exit do nothing,
and :func:`record` returns at its first test: a span costs a function call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.durable import fsync_path
from hpctrain.runtime.waiting import watching

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["span", "record", "now", "enabled", "start", "finish"]


class _Off:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class _Recorder:
    """This rank's spans: (name, track, start s, end s, args) in ``perf_counter`` time."""

    def __init__(self, path: str, rank: int, role: str) -> None:
        self.path = path
        self.rank = rank
        self.role = role
        self.origin = time.perf_counter()
        self.spans: list[tuple[str, object, float, float, dict[str, Any] | None]] = []
        self.threads: dict[int, str] = {}  # named when first seen: threads may end before

    def add(self, name: str, begin: float, end: float, key: object | None,
            args: dict[str, Any] | None) -> None:
        if key is None:
            key = threading.get_ident()
            if key not in self.threads:
                self.threads[key] = threading.current_thread().name
        self.spans.append((name, key, begin, end, args))


_recorder: _Recorder | None = None


class _Span:
    __slots__ = ("name", "args", "begin")

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.name = name
        self.args = args

    def __enter__(self) -> None:
        self.begin = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        recorder = _recorder
        if recorder is not None:
            recorder.add(self.name, self.begin, time.perf_counter(), None, self.args or None)


def enabled() -> bool:
    return _recorder is not None


def now() -> float:
    """The clock spans are measured in (``time.perf_counter``)."""
    return time.perf_counter()


def span(name: str, **args: Any) -> _Span | _Off:
    """A context manager recording ``name`` on the calling thread's track (``args`` are
    shown with it; ``step=`` lets the summary group spans by step)."""
    if _recorder is None:
        return _OFF
    return _Span(name, args)


def record(name: str, begin: float, end: float, track: str | None = None,
           **args: Any) -> None:
    """Record ``name`` from ``begin`` to ``end`` (:func:`now` times) on the calling thread's
    track, or on the named virtual ``track`` (for intervals that overlap the thread's own
    spans, such as a bucket's reduction running during backward)."""
    recorder = _recorder
    if recorder is not None:
        recorder.add(name, begin, end, track, args or None)


def start(path: str, world: MPI.Intracomm, role: str) -> None:
    """Start recording on every rank of ``world`` (collective: a barrier sets the common
    time origin); ``role`` names this rank's process in the file."""
    global _recorder
    with watching("barrier", world):
        world.Barrier()
    _recorder = _Recorder(path, world.Get_rank(), role)


def finish(world: MPI.Intracomm) -> str | None:
    """Stop recording and write the merged file (collective: a ``gather`` to world rank 0,
    which writes it atomically); returns the path on rank 0."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is None:
        return None
    with watching("gather", world):
        gathered = world.gather(_events(recorder), root=0)
    if world.Get_rank() != 0:
        return None
    events = [e for part in gathered for e in part]
    tmp = f"{recorder.path}.tmp{os.getpid()}"
    folder = os.path.dirname(os.path.abspath(recorder.path))
    os.makedirs(folder, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    fsync_path(tmp)
    os.replace(tmp, recorder.path)
    fsync_path(folder)
    return recorder.path


def _events(recorder: _Recorder) -> list[dict[str, Any]]:
    """The rank's spans as trace events, with the process and thread names as metadata;
    times in microseconds since the common origin."""
    pid = recorder.rank
    tids: dict[object, int] = {threading.main_thread().ident: 0}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": f"rank {pid} ({recorder.role})"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
         "args": {"sort_index": pid}}]
    origin = recorder.origin
    for name, key, begin, end, args in recorder.spans:
        tid = tids.get(key)
        if tid is None:
            tid = tids[key] = len(tids)
        event = {"ph": "X", "name": name, "pid": pid, "tid": tid,
                 "ts": round((begin - origin) * 1e6, 3),
                 "dur": round(max(0.0, end - begin) * 1e6, 3)}
        if args:
            event["args"] = args
        events.append(event)
    for key, tid in tids.items():
        label = "main" if tid == 0 else (key if isinstance(key, str) else
                                          recorder.threads.get(key, f"thread {tid}"))
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": label}})
    return events
