"""The planner's model: memory accounting against the real DLRM, Zipf estimates against the
generator, bubble and allreduce terms, ranking, cluster files and the plan command."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil

import numpy as np
import pytest

from hpctrain.comm.select import ranking
from hpctrain.comm.types import DTYPES, Layout, Request
from hpctrain.config import load_config
from hpctrain.data.synthetic import SyntheticClicks
from hpctrain.errors import ConfigError
from hpctrain.models.dlrm import DLRM
from hpctrain.plan import validate
from hpctrain.plan.cli import main
from hpctrain.plan.cluster import Device, load_cluster, machine_cluster, probe_reader
from hpctrain.plan.model import READ_COLD, allreduce_s, dense_params, predict, workload, zipf_unique
from hpctrain.plan.proposals import plan, proposal_of, rank_predictions
from hpctrain.plan.types import Proposal

DEVICE = Device(1e10, 5e9, 2e-6, 5e-8)
JOBS = ["jobs/configs/default.toml", "jobs/configs/dlrm_reference.toml",
        "jobs/configs/criteo_sample.toml"]


def cluster(ranks: int = 2, **keys) -> object:
    return load_cluster(None, {"nodes": 1, "ranks_per_node": ranks, "cores_per_node": ranks,
                               "memory_per_rank": "8GiB", "base_memory": "300MiB", **keys},
                        device=DEVICE)


@pytest.mark.parametrize("job", JOBS)
def test_dense_params_match_dlrm(job):
    config = load_config(job)
    model = DLRM(config.model, len(config.data.table_sizes))
    assert dense_params(workload(config)) == sum(p.numel() for p in model.parameters())


def test_memory_accounting_replicated_and_ps():
    config = load_config("jobs/configs/default.toml")
    w = workload(config)
    params, rows = dense_params(w), sum(config.data.table_sizes)
    rep = predict(w, Proposal(dp=2), cluster())
    worker = rep.ranks[0].memory
    assert worker["weights"] == worker["gradients"] == worker["optimizer_state"] == 4 * params
    assert worker["tables"] == rows * (16 + 1) * 4  # row-wise Adagrad: one value a row
    assert worker["base"] == 300 * 2**20
    ps = predict(w, Proposal("ps", 1, dp=1), cluster())
    worker, server = ps.ranks
    assert "tables" not in worker.memory and server.role == "server"
    assert server.memory["table_shards"] == rows * 17 * 4
    sgd = workload(load_config("jobs/configs/default.toml", ["train.optimizer='sgd'"]))
    assert predict(sgd, Proposal(dp=2), cluster()).ranks[0].memory["tables"] == rows * 16 * 4
    adamw = workload(load_config("jobs/configs/default.toml", ["train.optimizer='adamw'"]))
    memory = predict(adamw, Proposal(dp=2), cluster()).ranks[0].memory  # lazy-Adam tables
    assert memory["tables"] == rows * (16 + 2 * 16 + 1) * 4
    assert memory["optimizer_state"] == 2 * memory["weights"]  # dense m and v
    tp = predict(w, Proposal(dp=1, tp=2, micro_batches=2), cluster()).ranks[0].memory
    assert tp["weights"] < worker_weights_of(rep)


def test_zero_shards_the_state_and_gradients_and_prices_the_allgather():
    """ZeRO-1 over 4 workers keeps a quarter of Adam's state and pays the parameters'
    allgather; ZeRO-2 also a quarter of the gradient plus at most 1/16 of that in staging,
    with nothing of the reduction hidden; the plan proposes both and runs them as jobs."""
    config = load_config("jobs/configs/dlrm_reference.toml", ["train.optimizer='adam'"])
    w = workload(config)
    plain, one, two = (predict(w, Proposal(dp=4, zero=z), cluster(4)) for z in (0, 1, 2))
    grads = 4 * dense_params(w)
    assert plain.ranks[0].memory["optimizer_state"] == 2 * grads
    assert one.ranks[0].memory["optimizer_state"] == two.ranks[0].memory[
        "optimizer_state"] == 2 * grads / 4
    assert one.ranks[0].memory["gradients"] == grads
    assert two.ranks[0].memory["gradients"] == pytest.approx(grads / 4 * (1 + 1 / 16))
    assert one.ranks[0].time_s["dense_sync"] > plain.ranks[0].time_s["dense_sync"]
    assert one.ranks[0].time_s["optimizer"] < plain.ranks[0].time_s["optimizer"]
    names = {q.proposal.name: q for q in plan(config, cluster(4))}
    assert {"replicated/dp4/b25MiB/zero1", "replicated/dp4/b25MiB/zero2"} <= set(names)
    assert names["replicated/dp4/b25MiB/zero2"].feasible
    sgd = load_config("jobs/configs/dlrm_reference.toml")  # no dense state: ZeRO-2 only
    assert {q.proposal.zero for q in plan(sgd, cluster(4))} == {0, 2}
    job, lamb = "jobs/configs/dlrm_reference.toml", ["train.optimizer='lamb'"]
    refused = {q.proposal.name: q for q in plan(load_config(job, lamb), cluster(4), job, lamb)}[
        "replicated/dp4/b25MiB/zero1"]
    assert any("lamb" in r for r in refused.infeasible)
    own = proposal_of(load_config(job, ["train.zero=2"]), 4)  # the job's own layout
    assert own.zero == 2 and "train.zero=2" in own.overrides()


def test_local_sgd_and_16_bit_wires_are_priced_and_kept_by_every_layout():
    """local:4 averages a quarter as often (one bucket, nothing hidden: a quarter of the
    sync exactly); a 16-bit comm.wire_dtype makes the reduction cheaper; a 16-bit pipeline
    halves the bytes a later stage receives. Every proposal keeps the job's settings, and
    its overrides run them."""
    job = "jobs/configs/dlrm_reference.toml"
    w = workload(load_config(job))
    bsp, local = (predict(w, Proposal(dp=4, local_steps=h), cluster(4)) for h in (0, 4))
    assert local.ranks[0].time_s["dense_sync"] == pytest.approx(
        bsp.ranks[0].time_s["dense_sync"] / 4)
    bf16 = predict(w, Proposal(dp=4, wire_dtype="bf16"), cluster(4))
    assert bf16.ranks[0].time_s["dense_sync"] < bsp.ranks[0].time_s["dense_sync"]
    grid = Proposal(dp=2, pp=2, micro_batches=2)
    full, half = (predict(w, dataclasses.replace(grid, pipeline_wire=d), cluster(4))
                  for d in ("float32", "fp16"))
    assert half.ranks[1].input_bytes == pytest.approx(full.ranks[1].input_bytes / 2)
    keys = ["sync.dense='local:4'", "comm.wire_dtype='bf16'"]
    layouts = plan(load_config(job, keys), cluster(4), job, keys)
    assert all(q.proposal.local_steps == 4 and q.proposal.wire_dtype == "bf16" for q in layouts)
    assert layouts[0].proposal.name.endswith("/local4/bf16")
    ran = load_config(job, layouts[0].proposal.overrides())
    assert (ran.sync.dense, ran.comm.wire_dtype) == ("local:4", "bf16")
    own = proposal_of(load_config(job, ["parallel.pp=2", "parallel.wire_dtype='bf16'",
                                        "parallel.micro_batches=2"]), 4)
    assert own.pipeline_wire == "bf16" and own.pp == 2


def worker_weights_of(prediction) -> float:
    return prediction.ranks[0].memory["weights"]


def test_zipf_unique_matches_the_generator():
    sizes = [1000, 50000, 300]
    data = SyntheticClicks(sizes, 4096, 16, zipf=1.05, seed=3)
    ids = data.read("train", 0, 2048).sparse
    for t, n in enumerate(sizes):
        measured = len(np.unique(ids[:, t]))
        assert zipf_unique(n, 1.05, 2048) == pytest.approx(measured, rel=0.1)


def test_pipeline_bubble_share():
    w = workload(load_config("jobs/configs/default.toml"))
    for m in (2, 8):
        q = predict(w, Proposal(dp=1, pp=2, micro_batches=m), cluster())
        slowest = max(q.ranks, key=lambda r: r.step_s - r.time_s["bubble"])
        busy = slowest.step_s - slowest.time_s["bubble"]
        assert 1 - busy / q.step_s == pytest.approx(1 / (m + 1))


def test_allreduce_is_the_selectors_cheapest():
    c = cluster(4)
    req = Request("allreduce", 1 << 20, DTYPES["float32"])
    layout = Layout(4, 0, 4, 0, 1, True, False)
    best = min(cost.seconds for _, cost in ranking(req, layout, c.comm))
    assert allreduce_s(4 << 20, 4, c, False) == pytest.approx(best)
    assert allreduce_s(4 << 20, 1, c, False) == 0.0


def test_ranking_and_infeasible_reasons():
    config = load_config("jobs/configs/default.toml")
    predictions = plan(config, cluster(3), "jobs/configs/default.toml")
    assert len(predictions) >= 20
    feasible = [q for q in predictions if q.feasible]
    assert feasible and all(a.samples_per_s >= b.samples_per_s
                            for a, b in zip(feasible, feasible[1:], strict=False))
    reasons = {q.proposal.name: q.infeasible for q in predictions}
    assert any("do not divide" in r for rs in reasons.values() for r in rs)  # tp=2 on 3 ranks
    # the workers read balanced slices, so a batch that does not divide over dp runs
    assert not any("does not divide over dp" in r for rs in reasons.values() for r in rs)
    a2a = [q for q in predictions if q.proposal.embeddings == "alltoall"]
    assert a2a and all(not any("sharding" in r for r in q.infeasible)
                       for q in a2a)  # embeddings.mode = "alltoall" is built
    small = plan(config, cluster(2, memory_per_rank="310MiB"))
    assert not any(q.feasible for q in small)
    assert "over the 310 MiB per rank by" in small[0].infeasible[-1]
    shuffled = rank_predictions(list(reversed(predictions)))
    assert [q.proposal for q in shuffled] == [q.proposal for q in predictions]


def test_uneven_batch_slices_are_feasible():
    """The trainer balances uneven slices (512 over 3 workers: 171, 171, 170), so the
    planner must not reject the replicated and all-to-all layouts of 3 workers."""
    config = load_config("jobs/configs/default.toml")
    predictions = {q.proposal.name: q for q in plan(config, cluster(3))}
    for name in ("replicated/dp3/b25MiB", "a2a-table_wise/dp3/b25MiB"):
        assert predictions[name].feasible, predictions[name].infeasible
    # nor a replica batch that does not split evenly into micro-batches (65 into 2)
    config = load_config("jobs/configs/default.toml", ["train.batch_size=130"])
    predictions = {q.proposal.name: q for q in plan(config, cluster(4))}
    for name in ("replicated/dp2xtp1xpp2-m2-1f1b/b25MiB", "replicated/dp2xtp2xpp1-m2/b25MiB"):
        assert predictions[name].feasible, predictions[name].infeasible


def test_machine_cluster_and_oversubscription():
    c = machine_cluster(1, 4, device=DEVICE)
    assert c.ranks == 4 and c.memory_per_rank > 0
    shared = dataclasses.replace(c, cores_per_node=2)
    w = workload(load_config("jobs/configs/default.toml"))
    fast = predict(w, Proposal(dp=4), dataclasses.replace(c, cores_per_node=4))
    slow = predict(w, Proposal(dp=4), shared)
    assert slow.notes == ("ranks share cores",) and slow.step_s > 1.5 * fast.step_s


def test_cluster_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('nodes = 2\nranks_per_node = 4\nmemory_per_rank = "64GiB"\n'
                    '[inter]\nlatency = "5us"\nbandwidth = "200Gb/s"\n'
                    '[device]\nflops = "50T"\nmemory_bandwidth = "2TB/s"\n'
                    'op_latency = "10us"\nid_latency = "50ns"\n')
    c = load_cluster(path)
    assert c.ranks == 8 and c.memory_per_rank == 64 * 2**30
    assert c.comm.net.alpha == pytest.approx(5e-6) and c.comm.net.beta == pytest.approx(1 / 25e9)
    assert c.device.flops == 50e12 and c.device.source == "typed in"


@pytest.mark.parametrize(("text", "match"), [
    ("nodes = 1\nbogus = 3\n", "unknown key 'bogus'"),
    ("[intra]\nbandwidth = 0\n", "intra.bandwidth must be > 0"),
    ('memory_per_rank = "-4GiB"\n', "memory_per_rank must be > 0"),
    ("[device]\nspeed = 1\n", "unknown key 'device.speed'"),
    ('[inter]\nlatency = "fast"\n', "inter.latency: expected a seconds"),
    ("[inter]\nlatency = true\n", "inter.latency: expected a seconds quantity, got True"),
    ("nodes = [\n", "invalid TOML"),
    ("intra = 3\n", r"intra must be a table \[intra\]"),
    ("nodes = 1.5\n", "nodes must be a whole number, got 1.5"),
    ("calibration = 3\n", "calibration must be a file name, got 3"),
    ('memory_per_rank = "1GiB"\nbase_memory = "2GiB"\n',
     r"base_memory \(2048 MiB\) leaves nothing of memory_per_rank \(1024 MiB\)"),
])
def test_cluster_file_errors(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        load_cluster(path, device=DEVICE)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("argv", "words"), [
    (["--cluster", "{missing}"], "missing.toml: cannot read the cluster file"),
    (["--cluster", "{cluster}", "--nodes", "2"],
     "--cluster: give the sizes in the file, not also --nodes"),
    (["--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (["--ranks-per-node", "0"], "--ranks-per-node: must be >= 1, got 0"),
])
def test_cluster_flags_that_cannot_work_are_one_line(tmp_path, capsys, argv, words):
    """Sizes come from the cluster file or from the flags, never half from each."""
    cluster = tmp_path / "c.toml"
    cluster.write_text("nodes = 2\n")
    argv = [a.format(missing=tmp_path / "missing.toml", cluster=cluster) for a in argv]
    assert main(["jobs/configs/default.toml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_plan_command(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('ranks_per_node = 2\ncores_per_node = 2\nmemory_per_rank = "8GiB"\n'
                    'base_memory = "300MiB"\n[device]\nflops = 1e10\n'
                    'memory_bandwidth = 5e9\nop_latency = 2e-6\nid_latency = 5e-8\n')
    out = tmp_path / "best.toml"
    assert main(["jobs/configs/default.toml", "--cluster", str(path), "--json",
                 "--write", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["layouts"][0]
    assert best["feasible"] and len(result["layouts"]) >= 10
    written = load_config(out)
    assert written.ps.servers == best["proposal"]["servers"]
    assert written.parallel.tp == best["proposal"]["tp"]
    assert written.model == load_config("jobs/configs/default.toml").model
    path.write_text(path.read_text().replace("8GiB", "301MiB"))
    assert main(["jobs/configs/default.toml", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no layout fits" in err and "MiB over" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[inter]\nbandwidth = 0\n")
    assert main(["--cluster", str(bad)]) == 2
    assert "inter.bandwidth" in capsys.readouterr().err


def test_layouts_of_a_tiered_job_without_servers_turn_tiering_off():
    config = load_config("jobs/configs/tiered.toml")
    predictions = plan(config, cluster(1), "jobs/configs/tiered.toml")
    best = predictions[0]
    assert best.feasible and best.proposal.servers == 0
    assert load_config("jobs/configs/tiered.toml", best.proposal.overrides()).tiering.budget == 0


def test_layouts_of_a_full_mode_job_without_servers_run_hybrid(tmp_path):
    """ps.mode = 'full' without servers stops a training launch, so a layout without
    servers (replicated, all-to-all) written from a full-mode job must not keep it."""
    job = tmp_path / "full.toml"
    job.write_text('[ps]\nservers = 1\nmode = "full"\n')
    config = load_config(str(job))
    predictions = plan(config, cluster(3), str(job))
    serverless = [q for q in predictions if q.feasible and q.proposal.servers == 0]
    assert serverless
    for q in serverless:
        assert load_config(str(job), q.proposal.overrides()).ps.mode == "hybrid"


def test_reading_is_probed_on_the_jobs_own_reader_and_priced_per_sample(tmp_path, caplog):
    """Synthetic, Criteo text and gzipped text are timed on their own readers; data that
    cannot be read here leaves reading out with a warning; the step reads its worker's
    share of the batch."""
    synthetic = load_config("jobs/configs/default.toml")
    assert 0 < probe_reader(synthetic.data, 256, budget_s=0.01) < 1e-3
    criteo = load_config("jobs/configs/criteo_sample.toml").data
    assert probe_reader(criteo, 32, budget_s=0.01) > 0
    packed = tmp_path / "day_0.gz"
    with open(criteo.paths[0], "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert probe_reader(dataclasses.replace(criteo, paths=(str(packed),)), 32,
                        budget_s=0.01) > 0
    with caplog.at_level("WARNING"):
        gone = dataclasses.replace(criteo, paths=(str(tmp_path / "gone.txt"),))
        assert probe_reader(gone, 32) == 0.0
    assert "cannot read the job's data" in caplog.text
    w, none = workload(synthetic, read_s=2e-6), workload(synthetic)
    one, two = (predict(w, Proposal(dp=d), cluster(d)) for d in (1, 2))
    fixed = predict(none, Proposal(dp=1), cluster(1)).ranks[0].time_s["data"]
    assert one.ranks[0].time_s["data"] - fixed == pytest.approx(READ_COLD * 2e-6 * 512)
    assert two.ranks[0].time_s["data"] - fixed == pytest.approx(READ_COLD * 2e-6 * 256)


def test_an_all_to_all_job_is_predicted_as_its_own_layout():
    """A job with embeddings.mode = alltoall is planned as sharded (half the rows each at
    2 workers, its exchange and the owners' updates priced); over one worker sharding is
    the replicated layout, so it is not proposed."""
    job = "jobs/configs/default.toml"
    keys = ["embeddings.mode='alltoall'", "embeddings.sharding='row_wise'"]
    own = proposal_of(load_config(job, keys), 2)
    assert (own.embeddings, own.sharding, own.dp) == ("alltoall", "row_wise", 2)
    w = workload(load_config(job))
    a2a, rep = predict(w, own, cluster(2)), predict(w, Proposal(dp=2), cluster(2))
    assert a2a.ranks[0].memory["table_shards"] == pytest.approx(
        rep.ranks[0].memory["tables"] / 2)
    assert a2a.ranks[0].time_s["push"] > predict(w, dataclasses.replace(own, dp=1),
                                                 cluster(1)).ranks[0].time_s["push"]
    assert not any(q.proposal.embeddings == "alltoall" for q in plan(load_config(job),
                                                                     cluster(1)))


def test_a_jobs_own_stage_cuts_are_predicted_and_other_pipelines_are_balanced():
    """The job's ``parallel.stage_cuts`` shape its own layout's stages; proposals with
    another number of stages are cut balanced and stay runnable (their overrides clear the
    job's cuts, which would not fit them)."""
    job = "jobs/configs/default.toml"
    keys = ["parallel.pp=2", "parallel.micro_batches=4", "parallel.stage_cuts=[2]"]  # balanced: [1]
    config = load_config(job, keys)
    own = proposal_of(config, 2)
    assert own.stage_cuts == (2,) and "-cuts2" in own.name
    w = workload(config)
    first = predict(w, own, cluster(2)).ranks
    balanced = predict(w, dataclasses.replace(own, stage_cuts=()), cluster(2)).ranks
    assert [r.memory for r in first] != [r.memory for r in balanced]
    assert load_config(job, [*keys, *own.overrides()]).parallel.stage_cuts == (2,)
    for q in plan(config, cluster(4), job):
        assert not any("stage_cuts" in r for r in q.infeasible), q.proposal.name
        if q.proposal.pp not in (1, 2) or q.proposal.stage_cuts:
            continue
        load_config(job, [*keys, *q.proposal.overrides()])  # runnable: no ConfigError


def test_validation_leaves_a_first_runs_compilation_out_of_the_cpu_per_step(monkeypatch):
    """The first run of a layout in a process compiles its kernels on a machine's first
    run; taken as the one-step run, its CPU made the CPU per step negative."""
    cpu = iter([9.0, 1.0, 3.0])  # compiling one-step run, one-step run, a run of 5 steps
    runs = []

    def run(job, overrides, world_topo):
        runs.append([o for o in overrides if o.startswith("train.steps=")])
        return 0.002, 1 << 20, next(cpu)

    monkeypatch.setattr(validate, "_run", run)
    step, peak, per_step = validate._measure(None, [], ["train.steps=5"], ["train.steps=1"],
                                             None)
    assert runs == [["train.steps=1"], ["train.steps=1"], ["train.steps=5"]]
    assert (step, peak, per_step) == (0.002, 1 << 20, 0.5)  # (3 - 1) / 4


@pytest.mark.parametrize("mode", ["alltoall", "replicated", "ps"])
def test_every_layout_runs_its_own_tables_whatever_the_jobs_embeddings_mode(mode):
    """A job that names its embeddings.mode still gets every layout: the parameter-server
    ones feasible and the replicated ones writing (and running) replicated tables, not the
    job's mode."""
    keys = [f"embeddings.mode='{mode}'", *(["ps.servers=1"] if mode == "ps" else [])]
    config = load_config(None, keys)
    predictions = plan(config, cluster(3), None, keys)
    for kind in ("replicated", "ps", "alltoall"):
        assert any(q.feasible and q.proposal.embeddings == kind for q in predictions), kind
    for q in predictions:
        if q.feasible:
            ran = load_config(None, [*keys, *q.proposal.overrides()]).embeddings.mode
            assert ran == {"replicated": "replicated", "ps": "ps",
                           "alltoall": "alltoall"}[q.proposal.embeddings], q.proposal.name


def test_no_layout_sets_a_key_its_own_run_would_warn_is_unused():
    """A data-parallel layout left micro-batches at 1 (not the default), so each run of
    plan --validate and each written file warned that parallel.micro_batches is not used."""
    config = load_config("jobs/configs/default.toml")
    for q in plan(config, cluster(4)):
        if q.feasible:
            job = load_config("jobs/configs/default.toml", q.proposal.overrides())
            assert job.unused_keys() == [], q.proposal.name


def test_layouts_without_servers_of_an_ssp_sqrt_job_are_feasible(tmp_path):
    """sync.ssp_lr = 'sqrt' scales by the servers' staleness bound: a layout without servers
    runs it at a constant rate instead of being marked infeasible."""
    job = tmp_path / "ssp.toml"
    job.write_text("[ps]\nservers = 1\n[sync]\nmodel = 'ssp:4'\nssp_lr = 'sqrt'\n")
    predictions = plan(load_config(str(job)), cluster(3), str(job))
    serverless = [q for q in predictions if q.proposal.servers == 0]
    assert serverless and all(q.feasible for q in serverless if q.proposal.tp == 1
                              and q.proposal.pp == 1), [q.infeasible for q in serverless]
