"""The benchmarks' one writer: aligned tables, atomic JSON, PNG plots."""

import json

from hpctrain.bench.report import format_table, line_plot, write_json


def test_table_aligns_left_and_right_columns():
    text = format_table(["name", "x"], [["ring", "1.5"], ["auto (shm)", "12.25"]], left=1)
    assert text.splitlines() == ["name            x", "ring          1.5",
                                 "auto (shm)  12.25"]


def test_json_is_written_whole_and_plot_is_a_png(tmp_path):
    path = tmp_path / "rows.json"
    write_json(path, {"rows": [{"a": 1}]})
    write_json(path, {"rows": [{"a": 2}]})
    assert json.loads(path.read_text()) == {"rows": [{"a": 2}]}
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # no temporary left
    png = tmp_path / "plot.png"
    line_plot(png, {"a": [(1, 2.0), (2, 3.0)]}, "t", "x", "y", log_x=True,
              hlines=[(2.5, "ref")])
    assert png.read_bytes()[:4] == b"\x89PNG"
