"""The timeline recorder (off and on, in one process) and its summary on known numbers."""

import json
import threading

import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime import trace
from hpctrain.runtime.trace_summary import format_summary, load_events, summarize


class _Alone:
    """A one-rank world for the recorder's collectives (the parent pytest never starts MPI)."""

    def Barrier(self):
        pass

    def Get_rank(self):
        return 0

    def gather(self, value, root=0):
        return [value]


def _x(name, pid, ts, dur, tid=0, **args):
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def test_off_records_nothing_and_costs_a_shared_object():
    assert not trace.enabled()
    assert trace.span("a") is trace.span("b", step=1)
    with trace.span("a"):
        pass
    trace.record("b", 0.0, 1.0)


def test_on_writes_chrome_trace_events_per_thread(tmp_path):
    path = tmp_path / "t.json"
    trace.start(str(path), _Alone(), "worker")
    try:
        with trace.span("outer", step=0), trace.span("inner"):
            pass
        worker = threading.Thread(target=lambda: trace.record("side", trace.now(),
                                                              trace.now()), name="helper")
        worker.start()
        worker.join()
        trace.record("reduce", trace.now(), trace.now(), "bucket 0", bucket=0)
    finally:
        assert trace.finish(_Alone()) == str(path)
    assert not trace.enabled()
    events = json.loads(path.read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"outer", "inner", "side", "reduce"}
    assert spans["outer"]["tid"] == spans["inner"]["tid"] == 0
    assert spans["outer"]["args"] == {"step": 0} and spans["outer"]["pid"] == 0
    assert spans["inner"]["ts"] >= spans["outer"]["ts"]
    assert spans["inner"]["ts"] + spans["inner"]["dur"] <= \
        spans["outer"]["ts"] + spans["outer"]["dur"] + 0.01
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[0] == "main" and names[spans["side"]["tid"]] == "helper"
    assert names[spans["reduce"]["tid"]] == "bucket 0"
    assert len({spans[n]["tid"] for n in spans}) == 3


def test_summary_of_a_known_two_rank_trace(tmp_path):
    events = [
        # rank 0: step 0 lasts 100 us: data 10, forward 20, backward 40 (a 5 us wait in it),
        # optimizer 10, 20 untraced; step 1 lasts 50 us, all backward
        _x("step", 0, 0, 100, step=0), _x("data", 0, 0, 10, step=0),
        _x("forward", 0, 10, 20, step=0), _x("backward", 0, 30, 40, step=0),
        _x("wait pull", 0, 40, 5), _x("optimizer", 0, 70, 10, step=0),
        _x("step", 0, 200, 50, step=1), _x("backward", 0, 200, 50, step=1),
        _x("checkpoint", 0, 300, 30, step=2),
        # rank 1: step 0 takes 60 us, step 1 takes 80 us (the slowest)
        _x("step", 1, 0, 60, step=0), _x("backward", 1, 0, 60, step=0),
        _x("step", 1, 200, 80, step=1), _x("forward", 1, 200, 30, step=1),
        _x("push", 1, 230, 50, step=1),
        # rank 0's bucket reduction: 20 us, 10 of them during backward (30-70)
        _x("reduce", 0, 60, 20, tid=1, bucket=0),
        # rank 1's: 40 us during its backward (0-60) of step 0, 10 us after
        _x("reduce", 1, 20, 50, tid=1, bucket=0),
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "main"}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize(load_events(path))
    us = 1e-6
    expected = {"data": 10 * us, "forward": 50 * us, "backward": 35 * us,
                "wait pull": 5 * us, "optimizer": 10 * us, "push": 50 * us,
                "(untraced)": 20 * us}
    assert summary["critical_path"].keys() == expected.keys()
    for name, seconds in expected.items():
        assert abs(summary["critical_path"][name] - seconds) < 1e-12, name
    assert summary["outside_steps"].keys() == {"checkpoint"}
    assert abs(summary["outside_steps"]["checkpoint"] - 30 * us) < 1e-12
    bucket = summary["reductions"]["bucket 0"]
    assert bucket["reductions"] == 2
    assert abs(bucket["seconds"] - 70 * us) < 1e-12
    assert abs(bucket["hidden_s"] - 50 * us) < 1e-12
    assert [(r["step"], r["rank"]) for r in summary["slowest"]] == [(0, 0), (1, 1)]
    assert abs(summary["slowest"][1]["median_s"] - 65 * us) < 1e-12
    text = format_summary(summary)
    assert "hidden 71.4%" in text and "step      1  rank   1" in text


def test_a_file_that_is_no_trace_is_a_config_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_events(path)


@pytest.mark.parametrize(("text", "words"), [
    ('{"events": []}', "t.json: no traceEvents list"),
    ('{"traceEvents": [{"ph": "X", "ts": 1}]}', r"t.json: a complete event lacks ts/dur \('dur'\)"),
    ('{"traceEvents": []}', r"t.json: no spans \(complete events\) to summarize"),
    ('[1, 2]', "t.json: traceEvents holds something other than event objects"),
])
def test_json_that_is_no_timeline_is_a_config_error(tmp_path, text, words):
    """Valid JSON from another tool: what is missing is named, not a KeyError."""
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_events(path)
