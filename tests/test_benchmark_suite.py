"""The benchmark harness (benchmarks/): configuration list, figures derived from results,
goal table, report and chart, the worker's "not available" path, and one tiny unshaped
end-to-end run of the suite on loopback (a few dozen seconds)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import models, report, runner, suite, worker
from benchmarks.report import CONFIG_BY_NAME, CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_configuration_of_the_issue_is_in_the_suite():
    kinds = {c.name: (c.kind, c.options) for c in CONFIGS}
    assert kinds["single"] == ("single", {})
    assert kinds["mwms"] == ("mwms", {})
    # The fixed settings are not autotuned; "auto" is PoseidonStrategy's defaults (sfb="auto",
    # autotune=True), "auto+fp16" the same with compression="fp16".
    assert kinds["naive"] == ("poseidon", {"overlap": False, "sfb": "never", "autotune": False})
    assert kinds["dwbp"] == ("poseidon", {"sfb": "never", "autotune": False})
    assert kinds["fp16"][1] == {"compression": "fp16", "sfb": "never", "autotune": False}
    assert kinds["sfb"] == ("poseidon", {"autotune": False})
    assert kinds["auto"] == ("poseidon", {})
    assert kinds["auto+fp16"] == ("poseidon", {"compression": "fp16"})
    assert kinds["ssp"] == ("poseidon", {"mode": "ssp", "staleness": 2})
    assert kinds["easgd"] == ("poseidon", {"mode": "easgd", "tau": 4, "alpha": "0.9/P"})
    assert CONFIG_BY_NAME["easgd"].kwargs_for(2)["alpha"] == pytest.approx(0.45)
    assert CONFIG_BY_NAME["easgd"].kwargs_for(4)["alpha"] == pytest.approx(0.225)


def test_poseidon_options_are_valid_or_not_yet_implemented():
    from tf_poseidon.config import StrategyConfig
    for config in CONFIGS:
        if config.kind != "poseidon":
            continue
        for ranks in (2, 4):
            try:
                StrategyConfig(**config.kwargs_for(ranks))  # ValueError: a bug in the suite
                assert suite.precheck(config, ranks) is None
            except NotImplementedError as e:
                assert suite.precheck(config, ranks) == ("not available", str(e))


def test_precheck_reports_invalid_options_as_failed():
    bad = report.Config("bad", "bad", "poseidon", {"tau": 0})
    status, message = suite.precheck(bad, 2)
    assert status == "failed" and message.startswith("invalid options: ") and "tau" in message


def test_models_table_matches_the_built_models():
    for name in ("fc", "tiny"):  # the CNNs take seconds to build; their counts are in models.py
        assert models.build(models.MODELS[name]).count_params() == models.MODELS[name].params
    assert models.MODELS["fc"].params == 123_642_856  # 123.6 M, the VGG-16 head
    assert models.build(models.mlp(16, 2)).count_params() == models.mlp(16, 2).params
    x, y = models.synthetic_batch(models.MODELS["fc"], 4)
    assert x.shape == (4, 25088) and x.dtype.name == "float32" and y.max() < 1000


def test_rate_bits():
    assert report.rate_bits("1gbit") == 1e9
    assert report.rate_bits("10gbit") == 1e10
    assert report.rate_bits("500mbit") == 5e8
    assert report.rate_bits("100mbps") == 8e8
    assert report.rate_bits(None) is None
    with pytest.raises(ValueError):
        report.rate_bits("fast")


def test_plan_runs_references_first_then_each_cluster():
    settings = {"models": ["fc", "vgg"], "ranks": [2, 4], "bandwidths": ["1gbit", "10gbit"],
                "configs": ["single", "mwms", "dwbp"]}
    order = suite.plan(settings)
    assert [(r, b, m, c.name) for r, b, m, c in order[:2]] == [(1, None, "fc", "single"),
                                                                (1, None, "vgg", "single")]
    assert len(order) == 2 + 2 * 2 * 2 * 2
    assert [(r, b) for r, b, _, _ in order[2:6]] == [(2, "1gbit")] * 4
    default = suite.settings_from(suite.make_parser().parse_args([]))
    combos = {(r, b) for r, b, _, _ in suite.plan(default) if r > 1}
    assert combos == {(2, "1gbit"), (2, "10gbit"), (4, "1gbit")}
    chosen = suite.settings_from(suite.make_parser().parse_args(["--ranks", "4"]))
    assert {(r, b) for r, b, _, _ in suite.plan(chosen) if r > 1} == {(4, "1gbit"),
                                                                        (4, "10gbit")}


def rank_file(rank, window, steps=4, tx=1e9, stats=None, start=100.0):
    r = {"rank": rank, "batch": 32, "steps": steps, "window_s": window, "host": f"host{rank}",
         "start_s": start, "end_s": start + window,
         "step_times_s": [window / steps] * steps, "first_step_s": 9.0, "tx_bytes": tx,
         "rx_bytes": tx, "affinity_cpus": 2, "loadavg": 1.5}
    if stats:
        r["poseidon_stats"] = stats
    return r


def test_aggregate_counts_all_samples_over_the_slowest_rank():
    out = runner.aggregate([rank_file(1, 8.0, tx=2e9, start=101.0), rank_file(0, 4.0)])
    assert out["samples_per_s"] == pytest.approx(2 * 32 * 4 / 8.0)  # the slowest rank's time
    # latest end (109) minus earliest start (100)
    assert out["span_samples_per_s"] == pytest.approx(2 * 32 * 4 / 9.0)
    assert out["step_s"] == pytest.approx(2.0)
    assert out["tx_bytes_per_step"] == [2.5e8, 5e8]
    assert out["hosts"] == ["host0", "host1"]
    with_stats = runner.aggregate(
        [rank_file(0, 4.0, stats={"bytes_sent": 4e8, "hidden_fraction": 0.5})])
    assert with_stats["engine_bytes_per_step"] == 4e8 and with_stats["hidden_fraction"] == 0.5


def result(config, samples, step, ranks=2, bandwidth="1gbit", tx=None, model="fc",
           status="ok"):
    return {"model": model, "config": config, "ranks": ranks, "bandwidth": bandwidth,
            "status": status, "message": "" if status == "ok" else "why",
            "samples_per_s": samples, "step_s": step, "tx_bytes_per_step": tx,
            "loadavg": 2.0}


RESULTS = [
    result("single", 64.0, 0.5, ranks=1, bandwidth=None),
    result("mwms", 6.4, 10.0, tx=[5e8, 4.9e8]),
    result("naive", 16.0, 4.0, tx=[5e8, 5e8]),
    result("dwbp", 32.0, 2.0, tx=[5e8, 5e8]),
    result("sfb", 40.0, 1.6, tx=[4.9e8, 4.8e8]),
    result("ssp", None, None, status="not available"),
]


def test_derived_figures_floor_and_notes():
    rows = {r["config"]: r for r in report.derive(RESULTS)}
    dwbp = rows["dwbp"]
    assert dwbp["compute_s"] == 0.5
    assert dwbp["overhead"] == pytest.approx(4.0)
    assert dwbp["vs_mwms"] == pytest.approx(5.0)
    assert dwbp["vs_one_process"] == pytest.approx(0.5)
    assert dwbp["floor_s"] == pytest.approx(max(0.5, 5e8 * 8 / 1e9))
    assert "saved no traffic" in rows["sfb"]["notes"]
    assert rows["ssp"]["notes"] == "not available: why"
    assert rows["single"]["vs_mwms"] is None and rows["ssp"]["floor_s"] is None


def test_goals_pick_the_best_poseidon_configuration():
    (goal,) = report.goals(report.derive(RESULTS))
    assert goal["best"] == "sfb"
    assert goal["vs_mwms"] == pytest.approx(40 / 6.4) and goal["met_vs_mwms"] is True
    assert goal["met_vs_one_process"] is False  # 40 < 1.7 × 64
    assert goal["met_overhead"] is False        # 1.6 s vs 0.5 s compute
    cnn = [dict(r, model="resnet") for r in RESULTS]
    (goal,) = report.goals(report.derive(cnn))
    assert goal["goal_vs_mwms"] == report.GOAL_VS_MWMS_CNN


def test_markdown_and_chart(tmp_path, plotting_path):
    run = {"command": "python -m benchmarks.suite --models fc", "started": "t0", "finished": "t1",
           "status": "complete", "emulation": "test", "results": RESULTS,
           "environment": {"CPU": "test cpu"},
           "settings": {"models": ["fc"], "batch": 32, "warmup": 1, "steps": 2,
                        "timeout": 60.0}}
    text = report.markdown(run)
    assert "python -m benchmarks.suite --models fc" in text
    assert "| VGG-16 head (FC, 123.6 M) | 2 hosts × 1gbit | dwbp | 32.0 | 2.000 | 4.00× |" \
        in text
    assert "test cpu" in text
    assert "5.00× (goal ≥ 5×: met)" not in text  # the best is sfb, 6.25×
    assert "6.25× (goal ≥ 5×: met)" in text
    assert "not available: why" in text
    # Written into docs/benchmarks.md, the block replaces the previous results and keeps the
    # hand-written rest (the method, why Horovod is not compared).
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold results\n{report.END}\n\n"
                   "## Horovod\n\nhighwayhash\n")
    report.write_markdown(run, str(doc))
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nintro\n\n" + text.rstrip("\n"))
    assert written.endswith("\n\n## Horovod\n\nhighwayhash\n") and "old results" not in written
    report.write_markdown(run, str(tmp_path / "new.md"))  # no document yet: title and block
    assert (tmp_path / "new.md").read_text().endswith(text)
    report.chart(run, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_the_committed_results_rewrite_the_committed_pages():
    """What `--report-only docs/benchmarks/results.json` writes into docs/benchmarks.md, and the
    table `benchmarks.sparse --from-json docs/benchmarks/sparse.json` prints, are on the pages:
    the committed figures are reproduced by their commands."""
    docs = os.path.join(ROOT, "docs")
    with open(os.path.join(docs, "benchmarks", "results.json")) as f:
        block = report.markdown(json.load(f))
    with open(os.path.join(docs, "benchmarks.md")) as f:
        assert block.rstrip("\n") in f.read()
    with open(os.path.join(docs, "benchmarks", "sparse.json")) as f:
        rows = [line for line in runner.versus_table(json.load(f), "gradients") if "|" in line]
    with open(os.path.join(docs, "synchronization.md")) as f:
        page = f.read()
    assert len(rows) == 5 and all(row in page for row in rows)


def test_worker_records_not_implemented_as_not_available(tmp_path, monkeypatch):
    import tf_poseidon

    def not_yet(**kwargs):
        raise NotImplementedError("PoseidonStrategy: a feature is not implemented yet")

    monkeypatch.setattr(tf_poseidon, "PoseidonStrategy", not_yet, raising=False)
    worker.main(["--kind", "poseidon", "--model", "tiny", "--out", str(tmp_path), "--options",
                 '{"mode": "ssp", "staleness": 2}'])
    written = json.loads((tmp_path / "rank0.json").read_text())
    assert written["status"] == "not available"
    assert written["message"] == "PoseidonStrategy: a feature is not implemented yet"


@pytest.mark.multirank
def test_tiny_unshaped_run_end_to_end(tmp_path, plotting_path):
    """One step of the tiny model on loopback: reference, MWMS, tf_poseidon DWBP and
    autotuned (warmed up through its trials), each tf_poseidon one profiled for a step."""
    # `python -m benchmarks.suite` as users run it, but from a directory that holds only the
    # benchmarks package: the suite and its ranks then import the same tf_poseidon as this
    # test process (the installed one in CI's installed-package run, not the checkout's).
    (tmp_path / "benchmarks").symlink_to(os.path.join(ROOT, "benchmarks"))
    out = tmp_path / "out"  # not tmp_path: its benchmarks/ is the package
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite", "--no-netns", "--models", "tiny",
         "--ranks", "2", "--configs", "single", "mwms", "dwbp", "auto", "--warmup", "1",
         "--steps", "1", "--profile", "1", "--timeout", "240", "--out", str(out), "--logs",
         str(tmp_path / "logs")],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [os.environ.get("PYTHONPATH"), plotting_path]))})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads((out / "benchmarks" / "results.json").read_text())
    assert run["status"] == "complete"
    by_config = {r["config"]: r for r in run["results"]}
    assert set(by_config) == {"single", "mwms", "dwbp", "auto"}
    for r in by_config.values():
        assert r["status"] == "ok", r
        assert r["samples_per_s"] > 0 and r["steps"] == 1 and r["peak_rss_bytes"] > 1e8
    assert by_config["dwbp"]["ranks"] == 2 and len(by_config["dwbp"]["hosts"]) == 2
    for config in ("single", "dwbp", "auto"):
        phases = by_config[config]["profile"]["phases"]
        assert phases["compute"] > 0 and (config == "single") == (phases["wire"] == 0), phases
    assert "Where the step time goes" in (out / "benchmarks.md").read_text()
    assert "Goals (best tf_poseidon configuration)" in done.stdout
    assert (out / "benchmarks.md").exists() and (out / "benchmarks.png").exists()
