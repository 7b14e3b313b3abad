"""Low-rank compression (PowerSGD with error feedback): exactness at full rank, the error
feedback's bound, identical replicas, convergence on digits, the per-layer plan with every
protocol's estimate, resuming from a backup, and the knobs.

One real job of tests/workers/lowrank_train.py per world size (P=2: exactness, digits with
and without compression, plan, resume; P=3: exactness, digits with compression, error
feedback), and in-process tests of the pieces. Sync training at any number of ranks is one
process's (tests/test_sync_exactness.py), so the P=2 job's sync accuracy is the reference
for both.
"""

import dataclasses
import json

import numpy as np
import pytest

from multirank import check, run_job

P2_RUNS = ["exact", "digits-cnn-sync", "digits-cnn-lowrank", "digits-mlp-sync",
           "digits-mlp-lowrank", "plan", "resume"]
P3_RUNS = ["exact", "digits-cnn-lowrank", "digits-mlp-lowrank", "feedback"]


def _job(tmp_path_factory, num_ranks, runs):
    out = tmp_path_factory.mktemp(f"lowrank_p{num_ranks}")
    check(run_job(num_ranks, "lowrank_train.py", str(out), ",".join(runs), timeout=900)[0])
    return out, num_ranks


@pytest.fixture(scope="module")
def p2(tmp_path_factory):
    return _job(tmp_path_factory, 2, P2_RUNS)


@pytest.fixture(scope="module")
def p3(tmp_path_factory):
    return _job(tmp_path_factory, 3, P3_RUNS)


def report(job, run, rank=0):
    out, _ = job
    return json.loads((out / f"{run}_rank{rank}.json").read_text())


def arrays(job, run, rank=0):
    out, _ = job
    return np.load(out / f"{run}_rank{rank}.npz")


# -- correctness -------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("job_name", ["p2", "p3"])
def test_full_rank_without_warm_up_equals_the_exact_sum(request, job_name):
    # Every matrix (a conv kernel as 9x4, Dense 256x16 and 16x5) low-rank at rank >= min(m, n),
    # SGD, 233 rows at global batch 64: uneven shares at P=2 (last batch 20/21) and P=3 (every
    # batch 21/21/22). The first step's update and the weights after 8 steps equal all-reduce's.
    job = request.getfixturevalue(job_name)
    plan = report(job, "exact")["plan"]
    assert [row["choice"] for row in plan["rows"]] == ["lowrank"] * 3
    initial = arrays(job, "exact", 0)["initial"]  # rank 0's: broadcast to every rank
    for rank in range(job[1]):
        result = arrays(job, "exact", rank)
        exact_update = result["allreduce_first"] - initial
        lowrank_update = result["lowrank_first"] - initial
        assert np.max(np.abs(exact_update)) > 1e-3
        difference = np.max(np.abs(lowrank_update - exact_update))
        assert difference <= 1e-4 * np.max(np.abs(exact_update)), difference
        assert np.max(np.abs(result["lowrank_end"] - result["allreduce_end"])) <= 1e-4


@pytest.mark.parametrize("job_name, runs", [
    ("p2", ["exact", "digits-cnn-lowrank", "digits-mlp-lowrank"]),
    ("p3", ["exact", "digits-cnn-lowrank", "digits-mlp-lowrank"])])
@pytest.mark.multirank
def test_every_rank_holds_the_same_weights_after_every_step(request, job_name, runs):
    job = request.getfixturevalue(job_name)
    for run in runs:
        digests = [report(job, run, rank)["digests"] for rank in range(job[1])]
        assert len(digests[0]) >= 8
        assert all(d == digests[0] for d in digests[1:]), run


@pytest.mark.multirank
def test_error_feedback_keeps_the_applied_updates_within_a_bound_of_the_exact_ones(p3):
    # 150 steps of rank-2 compression of 24x24 and 40x16 gradients (a common direction plus
    # noise) on 3 ranks, uneven batch shares every 7th step (one rank without examples).
    result = report(p3, "feedback")
    kept, cleared = result["feedback"], result["cleared"]
    # Σ_steps exact − Σ_steps applied is exactly what the ranks' residuals hold.
    assert kept["conservation"] <= 1e-6 * kept["scale"]
    # So the gap stays bounded: with a rank-r projection capturing at least δ = r/min(m, n) of
    # a matrix's energy, ‖residual‖ ≤ √(1−δ)/(1−√(1−δ)) · max‖gradient‖.
    delta = 2 / 16
    bound = np.sqrt(1 - delta) / (1 - np.sqrt(1 - delta)) * max(kept["norms"])
    assert max(kept["gaps"]) <= bound
    # Without the residuals the approximation errors add up step after step.
    assert cleared["gaps"][-1] > 3 * bound
    assert cleared["gaps"][-1] > 2.5 * cleared["gaps"][len(cleared["gaps"]) // 3]
    for rank in range(1, 3):  # every rank got the same result every step
        other = report(p3, "feedback", rank)
        assert other["feedback"]["digests"] == kept["digests"]
        assert other["cleared"]["digests"] == cleared["digests"]


# -- convergence -------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("job_name", ["p2", "p3"])
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_digits_accuracy_with_rank_4_is_within_one_percent_of_sync(request, p2, job_name,
                                                                  model):
    job = request.getfixturevalue(job_name)
    sync = report(p2, f"digits-{model}-sync")["accuracy"]
    lowrank = report(job, f"digits-{model}-lowrank")
    assert sync > 0.95
    assert abs(lowrank["accuracy"] - sync) <= 0.01, (lowrank["accuracy"], sync)
    assert "lowrank" in [row["choice"] for row in lowrank["plan"]["rows"]]


@pytest.mark.multirank
def test_low_rank_layers_send_a_fraction_of_the_bytes(p2):
    sync = report(p2, "digits-mlp-sync")["per_layer"]
    lowrank = report(p2, "digits-mlp-lowrank")["per_layer"]

    def kernel_bytes(per_layer):
        return sum(v["bytes_sent"] for k, v in per_layer.items() if k.endswith("kernel"))
    # 64x128, 128x64, 64x10 at rank 4: (m+n)·4 values each instead of m·n, two rounds.
    assert kernel_bytes(lowrank) < kernel_bytes(sync) / 6
    compute = report(p2, "digits-mlp-lowrank")["mode"]["lowrank_compute_s"]
    assert compute and all(0 < seconds < 1 for seconds in compute)


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.multirank
def test_plan_shows_every_protocols_bytes_and_time_and_picks_the_fastest(p2):
    # bandwidth_gbps=0.05, global batch 64: K = 32 per rank; sfb="auto", PowerSGD(rank=4).
    result = report(p2, "plan")
    plan, table = result["plan"], result["table"]
    assert plan["lowrank"].startswith("PowerSGD(rank=4")
    assert plan["rates"]["lowrank_elements_s"] > 0 and plan["rates"]["copy_bytes_s"] > 0
    rows = {row["kernel"].split("/")[-2]: row for row in plan["rows"]}
    assert set(rows) == {"conv", "wide", "square", "logits"}
    for name, (m, n) in {"conv": (27, 32), "wide": (2048, 256), "square": (256, 256),
                         "logits": (256, 10)}.items():
        row = rows[name]
        assert row["shape"] == [m, n]
        assert row["bytes_allreduce"] == 2 * 1 / 2 * m * n * 4  # 2(P-1)/P·m·n·b
        assert row["bytes_lowrank"] == 2 * 1 / 2 * (m + n) * 4 * 4  # 2(P-1)/P·(m+n)·r·b
        usable = [e for e in row["estimates"] if e["refusal"] is None]
        fastest = min(usable, key=lambda e: e["time_s"])
        assert row["choice"] == fastest["protocol"], row
    assert rows["wide"]["bytes_sfb"] == 1 * 32 * (2048 + 256) * 4  # (P-1)·K·(M+N)·b
    assert rows["conv"].get("bytes_sfb") is None  # convolutions: no SFB
    assert rows["square"]["choice"] == rows["wide"]["choice"] == "lowrank"
    assert "low-rank" in table and "SFB" in table and "all-reduce" in table
    assert report(p2, "plan", 1)["plan"]["rows"] == plan["rows"]


# -- checkpoints -------------------------------------------------------------------------------

@pytest.mark.multirank
def test_resuming_from_a_backup_continues_like_the_uninterrupted_run(p2):
    entries = report(p2, "resume")["state_entries"]
    assert entries["algorithm/lowrank/mlp/h1/kernel/residual"] == [64, 128]
    assert entries["algorithm/lowrank/mlp/h1/kernel/q"] == [128, 2]
    assert report(p2, "resume")["metadata"]["steps_done"] == 8  # after 30 steps: epoch 2
    for rank in range(2):
        result = arrays(p2, "resume", rank)
        resumed = np.max(np.abs(result["resumed"] - result["uninterrupted"]))
        assert resumed <= 1e-5, resumed
        # The residuals matter: without them the same resume ends elsewhere.
        lost = np.max(np.abs(result["resumed_without_lowrank_state"]
                             - result["uninterrupted"]))
        assert lost > 100 * 1e-5, lost


# -- the pieces, in this process ---------------------------------------------------------------

def test_knobs_are_validated_with_a_message_naming_them():
    import tf_poseidon as tp
    from tf_poseidon.config import StrategyConfig
    for bad in ({"rank": 0}, {"rank": 2.0}, {"start_step": -1}, {"min_compression": 0},
                {"choice": "never"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tp.PowerSGD(**bad)
    assert StrategyConfig(lowrank={"rank": 2}).lowrank == tp.PowerSGD(rank=2)
    with pytest.raises(ValueError, match="unknown options"):
        StrategyConfig(lowrank={"ranks": 2})
    with pytest.raises(ValueError, match="lowrank"):
        StrategyConfig(lowrank="powersgd")
    with pytest.raises(ValueError, match="mode='sync'"):
        StrategyConfig(mode="easgd", tau=4, alpha=0.45, lowrank=tp.PowerSGD())
    assert repr(tp.PowerSGD()) == ("PowerSGD(rank=4, start_step=10, min_compression=2.0, "
                                   "choice='auto')")


def test_matrix_shapes_ranks_and_eligibility():
    from tf_poseidon.lowrank import PowerSGD, matrix_shape
    assert matrix_shape((3, 3, 16, 32)) == (144, 32)
    assert matrix_shape((64, 10)) == (64, 10)
    assert matrix_shape((10,)) is None and matrix_shape(()) is None
    assert matrix_shape((None, 4)) is None
    options = PowerSGD(rank=4)
    assert options.matrix_rank(3, 100) == 3
    assert options.compression(256, 256) == 256 * 256 / (512 * 4)
    assert options.refusal(256, 256) is None
    assert "1.44x < min_compression 2" in options.refusal(9, 16)


def test_cost_model_weighs_all_reduce_sfb_and_low_rank():
    from tf_poseidon.lowrank import PowerSGD
    from tf_poseidon.sacp import cost_model, plan as plan_lib
    rates = cost_model.Rates(1e9 / 8, 1e-4, 1e10, "given", 1e8)  # 1 Gbit/s
    cost = cost_model.lowrank_cost(4096, 4096, 4, 32, 4, 4, rates)
    assert cost.bytes_lowrank == 2 * 3 / 4 * 8192 * 4 * 4
    assert cost.time_lowrank_s < cost.time_allreduce_s
    fc = plan_lib.Candidate("fc/kernel", 4096, 4096, 32, None, lowrank=True)
    row = plan_lib._row(fc, 32, "auto", 4, 4, rates, PowerSGD())
    assert row.protocols == ("allreduce", "sfb", "lowrank")
    assert row.choice == "lowrank" and row.reason.startswith("low-rank fastest")
    small = plan_lib.Candidate("small/kernel", 32, 32, 32, None, lowrank=True)
    assert plan_lib._row(small, 32, "auto", 4, 4, rates, PowerSGD()).choice == "allreduce"
    forced = plan_lib._row(small, 32, "auto", 4, 4, rates, PowerSGD(choice="always"))
    assert forced.choice == "lowrank" and "always" in forced.reason
    tiny = plan_lib.Candidate("tiny/kernel", 9, 16, None, None, plan_lib.ALLREDUCE,
                              lowrank=True)
    refused = plan_lib._row(tiny, None, "auto", 4, 4, rates, PowerSGD(choice="always"))
    assert refused.choice == "allreduce" and "min_compression" in refused.reason
    assert refused.estimate("lowrank").refusal is not None
    table = plan_lib.Plan([row, refused], 4, "auto", "none", rates, lowrank="PowerSGD()").table()
    assert "low-rank" in table and "(no)" in table


def test_the_low_rank_probe_is_the_largest_matrix_up_to_its_cap():
    """The rate per element falls as the passes leave the caches: the probe times the model's
    largest compressible matrix, and no larger than PROBE_LOWRANK."""
    from tf_poseidon.sacp import cost_model
    shape = cost_model.lowrank_probe_shape
    assert shape([(1152, 128), (4608, 512), (256, 10)]) == (4608, 512)
    assert shape([(25088, 4096), (4096, 4096)]) == cost_model.PROBE_LOWRANK
    assert shape([]) == cost_model.PROBE_LOWRANK


def test_the_hand_over_counts_where_the_whole_gradient_moves():
    """All-reduce and low-rank copy the whole gradient into the engine and its sum back, SFB
    only its factors: with the copy rate measured, a layer low-rank wins on compute alone goes
    to SFB (the FC head's first layer at 4 ranks sharing 2 cores, at rates measured so)."""
    from tf_poseidon.lowrank import PowerSGD
    from tf_poseidon.sacp import cost_model, plan as plan_lib
    m, n, k, p = 25088, 4096, 32, 4
    rates = cost_model.Rates(0.93e9 / 8, 5e-5, 20.8e9, "measured", 110e6)
    copying = dataclasses.replace(rates, copy_bytes_s=3.76e9)
    free, paid = (cost_model.lowrank_cost(m, n, 4, k, p, 4, r) for r in (rates, copying))
    whole = 2 * m * n * 4 / 3.76e9
    assert paid.time_allreduce_s - free.time_allreduce_s == pytest.approx(whole)
    assert paid.time_lowrank_s - free.time_lowrank_s == pytest.approx(whole)
    free_sfb, paid_sfb = (cost_model.layer_cost(m, n, k, p, 4, r) for r in (rates, copying))
    assert paid_sfb.time_sfb_s - free_sfb.time_sfb_s == pytest.approx(
        (1 + p) * k * (m + n) * 4 / 3.76e9)
    fc1 = plan_lib.Candidate("fc/fc1/kernel", m, n, k, None, lowrank=True)
    assert plan_lib._row(fc1, k, "auto", p, 4, rates, PowerSGD()).choice == "lowrank"
    assert plan_lib._row(fc1, k, "auto", p, 4, copying, PowerSGD()).choice == "sfb"
