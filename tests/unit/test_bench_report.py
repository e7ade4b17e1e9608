"""The benchmarks' one writer: aligned tables, atomic JSON, PNG plots."""

import json

from hpctrain.bench.report import format_table, line_plot, mean_row, print_rows, write_json


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


def test_repeated_runs_average_and_a_single_pair_says_it_has_no_interval(capsys):
    from hpctrain.bench import embeddings, tiering

    row = mean_row([{"layout": "ps:1", "workers": 3, "samples_per_s": 10.0},
                    {"layout": "ps:1", "workers": 3, "samples_per_s": 20.0}])
    assert row == {"layout": "ps:1", "workers": 3, "samples_per_s": 15.0}
    print_rows([{"speedup": 0.9, "speedup_lo": None}], ["speedup", "speedup_lo"])
    assert capsys.readouterr().out.splitlines()[1].split() == ["0.900", "-"]
    assert "single pair" in tiering.notes([{"pair_speedups": [0.9]}])
    assert "over 3 pairs" in tiering.notes([{"pair_speedups": [0.9, 1.0, 1.1]}])
    emulated = {"pair_speedups": [0.9], "zipf": 1.05, "hot_fraction": 0.1,
                "network_share": 0.2, "tiered_network_share": 0.3, "network_bound": 1.25}
    assert "waited 20.0% of their time for the emulated network (largest worker; tiered " \
           "30.0%), so no cut in network time speeds them up more than 1.250x" in \
           tiering.notes([emulated])
    assert "single round" in embeddings.speed_note([{"rounds": 1}])
    assert "over 2 rounds" in embeddings.speed_note([{"rounds": 2}])
