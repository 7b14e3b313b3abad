"""mode="easgd": elastic averaging SGD, synchronous (all-reduce) and asynchronous (center holder).

Real jobs (tests/workers/easgd_check.py, easgd_digits.py):
* the synchronous form replayed exactly in numpy (local SGD steps, elastic move every τ steps
  counted across epochs and ``steps_per_execution`` loops, validation and ``consistent_state``
  in the middle of training, a second fit from new weights), P=3; and with its all-reduce in
  bfloat16, P=2;
* the asynchronous form's protocol alone (tests/workers/easgd_center_check.py), P=3, in many
  chunks, checked exactly;
* the asynchronous form, P=2, with rank 1 slowed by a callback: rank 0 is not held back; the
  center is what every rank gets from ``consistent_state``, ``fit`` and ``evaluate``;
* convergence: examples/train_digits.py within 2% of sync mode's test accuracy, both forms,
  with the documented τ=4, α=0.9/P (docs/easgd.md), P=2 and P=3.
"""

import json

import numpy as np
import pytest

from multirank import check, run_job

import tf_poseidon as tp
from tf_poseidon import world
from tf_poseidon.comm.engine import CollectiveTimeoutError
from tf_poseidon.config import StrategyConfig
from tf_poseidon.algorithms import easgd_center

TOLERANCE = 1e-4


# -- arguments (no job needed) ---------------------------------------------------------------

def test_synchronous_alpha_times_ranks_must_stay_below_one(monkeypatch):
    monkeypatch.setattr(world, "size", lambda: 3)
    with pytest.raises(ValueError) as error:
        StrategyConfig(mode="easgd", alpha=0.5)
    message = str(error.value)
    for part in ("alpha=0.5", "3 ranks", "alpha·P = 1.5", "< 1", "alpha=0.3", "easgd_async"):
        assert part in message
    with pytest.raises(ValueError):
        StrategyConfig(mode="easgd", alpha=1 / 3)  # α·P = 1: the center jumps to the mean
    StrategyConfig(mode="easgd", alpha=0.3)
    StrategyConfig(mode="easgd", alpha=0.5, easgd_async=True)  # the async form has no bound
    StrategyConfig(mode="sync", alpha=0.5)  # alpha matters only with mode="easgd"


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_the_default_alpha_is_accepted_at_every_world_size(monkeypatch, ranks):
    """Defaults that are refused are defects: alpha left out is 0.9/P, so alpha·P < 1."""
    monkeypatch.setattr(world, "size", lambda: ranks)
    for algorithm in (StrategyConfig(mode="easgd", tau=4).algorithm,
                      StrategyConfig(tp.algorithms.EASGD(tau=4)).algorithm):
        assert algorithm.alpha is None and algorithm.tau == 4
        assert algorithm.alpha_for(ranks) * ranks == pytest.approx(0.9)


@pytest.mark.parametrize("kwargs", [dict(tau=0), dict(tau=2.5), dict(alpha=0.0),
                                    dict(alpha=1.5)])
def test_invalid_tau_and_alpha(kwargs):
    with pytest.raises(ValueError) as error:
        StrategyConfig(mode="easgd", **kwargs)
    assert next(iter(kwargs)) in str(error.value)


def test_a_wait_for_the_center_holder_times_out_with_a_message():
    with pytest.raises(CollectiveTimeoutError) as error:
        easgd_center._poll(lambda: False, 0.05, "an exchange with the EASGD center holder "
                           "(rank 0)")
    assert "center holder (rank 0)" in str(error.value)
    assert "TF_POSEIDON_TIMEOUT" in str(error.value)


# -- the synchronous form, replayed -----------------------------------------------------------

def replay_sync(x, y, workers, center, batch, steps, tau, alpha, lr, snapshot_step=0,
                first_step=1):
    """Local SGD on Dense(1)+MSE per rank, elastic move every τ steps (counting from
    ``first_step``, as the algorithm's counter does across fits); float64."""
    workers = [w.astype(np.float64).copy() for w in workers]
    center = center.astype(np.float64).copy()
    num_ranks, snapshot = len(workers), None
    rows_per_epoch = len(x) // batch
    for i in range(steps):
        step = first_step + i
        start = (i % rows_per_epoch) * batch
        for r in range(num_ranks):
            lo, hi = start + batch * r // num_ranks, start + batch * (r + 1) // num_ranks
            xb, yb = x[lo:hi].astype(np.float64), y[lo:hi, 0].astype(np.float64)
            w = workers[r]
            residual = 2.0 * (xb @ w[:-1] + w[-1] - yb) / len(xb)
            workers[r] = w - lr * np.concatenate([xb.T @ residual, [residual.sum()]])
        if step % tau == 0:
            moves = [alpha * (w - center) for w in workers]
            workers = [w - d for w, d in zip(workers, moves)]
            center = center + sum(moves)
        if i + 1 == snapshot_step:
            snapshot = ([w.copy() for w in workers], center.copy())
    return workers, center, snapshot


def run_check(tmp_path, num_ranks, *args):
    result, _ = run_job(num_ranks, "easgd_check.py", str(tmp_path), *args, timeout=240)
    check(result)
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(num_ranks)]


@pytest.mark.multirank
def test_synchronous_form_is_exactly_elastic_averaging(tmp_path):
    num_ranks, tau, alpha, batch, epochs, lr = 3, 3, 0.3, 12, 2, 0.05
    ranks = run_check(tmp_path, num_ranks, "--tau", str(tau), "--alpha", str(alpha),
                      "--batch", str(batch), "--epochs", str(epochs),
                      "--steps-per-execution", "2", "--learning-rate", str(lr), "--second-fit")
    x, y = ranks[0]["x"], ranks[0]["y"]
    steps_per_epoch = len(x) // batch
    initial = ranks[0]["initial"]  # rank 0's, broadcast
    workers, center, (workers_epoch0, center_epoch0) = replay_sync(
        x, y, [initial] * num_ranks, initial, batch, epochs * steps_per_epoch, tau, alpha, lr,
        steps_per_epoch)
    assert not np.allclose(workers[0], workers[1])  # the ranks did drift apart
    for r, saved in enumerate(ranks):
        # Local weights during and at the end of training; the center inside consistent_state.
        np.testing.assert_allclose(saved["epoch0_local"], workers_epoch0[r], atol=TOLERANCE)
        np.testing.assert_allclose(saved["epoch0_center"], center_epoch0, atol=TOLERANCE)
        np.testing.assert_array_equal(saved["epoch0_nested"], saved["epoch0_center"])
        np.testing.assert_array_equal(saved["epoch0_after"], saved["epoch0_local"])
        np.testing.assert_allclose(saved["final_local"], workers[r], atol=TOLERANCE)
        # After fit every rank holds the center, bit for bit the same on every rank.
        np.testing.assert_allclose(saved["after_fit"], center, atol=TOLERANCE)
        np.testing.assert_array_equal(saved["after_fit"], ranks[0]["after_fit"])
        np.testing.assert_array_equal(saved["epoch0_center"], ranks[0]["epoch0_center"])
        mse = float(np.mean((x @ center[:-1] + center[-1] - y[:, 0]) ** 2))
        assert saved["evaluate"][0] == pytest.approx(mse, rel=1e-4)
        np.testing.assert_array_equal(saved["after_evaluate"], saved["after_fit"])
        stats = json.loads(str(saved["stats"]))
        assert stats["form"] == "sync" and stats["tau"] == tau
    # A second fit after setting different weights on every rank: the center restarts from
    # rank 0's, each rank from its own; the step counter (hence the τ phase) carries on.
    second_workers, second_center, _ = replay_sync(
        x, y, [saved["second_initial"] for saved in ranks], ranks[0]["second_initial"], batch,
        steps_per_epoch, tau, alpha, lr, first_step=epochs * steps_per_epoch + 1)
    for r, saved in enumerate(ranks):
        np.testing.assert_allclose(saved["second_final_local"], second_workers[r],
                                   atol=TOLERANCE)
        np.testing.assert_allclose(saved["second_after_fit"], second_center, atol=TOLERANCE)
        np.testing.assert_array_equal(saved["second_after_fit"], ranks[0]["second_after_fit"])


@pytest.mark.multirank
def test_synchronous_form_with_a_16_bit_elastic_all_reduce(tmp_path):
    num_ranks, tau, alpha, batch, lr = 2, 2, 0.45, 12, 0.05
    ranks = run_check(tmp_path, num_ranks, "--tau", str(tau), "--alpha", str(alpha),
                      "--batch", str(batch), "--epochs", "1", "--learning-rate", str(lr),
                      "--compression", "bf16")
    x, y = ranks[0]["x"], ranks[0]["y"]
    initial = ranks[0]["initial"]
    _, center, _ = replay_sync(x, y, [initial] * num_ranks, initial, batch, len(x) // batch,
                               tau, alpha, lr)
    difference = np.max(np.abs(ranks[0]["after_fit"] - center))
    assert 1e-6 < difference < 5e-3  # the d_p travelled in bfloat16, and only they did
    np.testing.assert_array_equal(ranks[1]["after_fit"], ranks[0]["after_fit"])


# -- the asynchronous form ---------------------------------------------------------------------

@pytest.mark.multirank
def test_center_protocol_in_many_chunks_with_interleaved_workers():
    # Pure protocol (easgd_center.py, no TensorFlow ops): 64-byte chunks, float32, float64 and
    # bfloat16, 3 ranks exchanging at once, groups registered on rank 0 after their first
    # exchange was sent.
    result, _ = run_job(3, "easgd_center_check.py", timeout=120, env={"TF_POSEIDON_TIMEOUT": "30"})
    output = check(result)
    for rank in range(3):
        assert f"CENTER OK rank {rank}" in output


@pytest.mark.multirank
def test_asynchronous_form_does_not_wait_for_a_slow_rank(tmp_path):
    steps, slow_s = 20, 0.25
    ranks = run_check(tmp_path, 2, "--async", "--tau", "1", "--alpha", "0.5", "--batch", "6",
                      "--epochs", "1", "--slow-rank", "1", "--slow-s", str(slow_s),
                      "--second-fit")
    fast, slow = (np.asarray(r["batch_end_s"]) for r in ranks)
    assert len(fast) == len(slow) == steps
    # Rank 1 sleeps 0.25 s before each step; rank 0 runs its 19 later steps in far less time
    # than rank 1 needs for them (it would need at least as long if it waited for rank 1).
    assert slow[-1] - slow[0] >= (steps - 1) * slow_s
    assert fast[-1] - fast[0] < 0.5 * (slow[-1] - slow[0]), (fast, slow)
    assert fast[-1] < slow[-1] - 2.0
    for r, saved in enumerate(ranks):
        stats = json.loads(str(saved["stats"]))
        assert stats["form"] == "async" and stats["exchanges"] == steps
        if r == 0:
            assert stats["served"]["exchanges"] == steps  # all of rank 1's
        else:
            assert stats["bytes_sent"] == stats["bytes_received"] == steps * 5 * 4
        # consistent_state and fit's end give every rank the center rank 0 holds.
        np.testing.assert_array_equal(saved["epoch0_center"], ranks[0]["epoch0_center"])
        np.testing.assert_array_equal(saved["epoch0_after"], saved["epoch0_local"])
        np.testing.assert_array_equal(saved["after_fit"], ranks[0]["after_fit"])
        np.testing.assert_array_equal(saved["evaluate"], ranks[0]["evaluate"])
        np.testing.assert_array_equal(saved["after_evaluate"], saved["after_fit"])
    # With one epoch, epoch 0's end is the end of training: the center is what fit leaves.
    np.testing.assert_array_equal(ranks[0]["epoch0_center"], ranks[0]["after_fit"])
    assert not np.array_equal(ranks[0]["final_local"], ranks[1]["final_local"])
    # A second fit from different weights on each rank (rank 0 restarts the center it holds
    # from its own) ends, again, with the same center on every rank.
    np.testing.assert_array_equal(ranks[0]["second_after_fit"], ranks[1]["second_after_fit"])
    assert not np.array_equal(ranks[0]["second_after_fit"], ranks[0]["after_fit"])


# -- convergence of the example -----------------------------------------------------------------

@pytest.fixture(scope="module")
def sync_accuracy():
    """Sync mode's test accuracy: sync mode at P ranks is one process at the same global batch
    (tests/test_sync_exactness.py), so one plain process gives it for every P."""
    result, _ = run_job(0, "easgd_digits.py", "--runs", "sync", timeout=300)
    return digits_accuracy(check(result))["sync"]


def digits_accuracy(output: str) -> dict:
    line = [l for l in output.splitlines() if l.startswith("ACCURACY ")][-1]
    return json.loads(line[len("ACCURACY "):])


@pytest.mark.multirank
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_digits_example_converges_like_sync_mode(num_ranks, sync_accuracy):
    alpha = f"{0.9 / num_ranks:.3g}"  # the documented default: α = 0.9/P, τ = 4
    result, _ = run_job(num_ranks, "easgd_digits.py", "--tau", "4", "--alpha", alpha,
                        "--async-alpha", alpha, "--runs", "easgd,easgd_async", timeout=420)
    accuracy = digits_accuracy(check(result))
    print(f"P={num_ranks}: sync {sync_accuracy:.4f}, {accuracy}")
    assert sync_accuracy > 0.9
    assert accuracy["easgd"] >= sync_accuracy - 0.02, (sync_accuracy, accuracy)
    assert accuracy["easgd_async"] >= sync_accuracy - 0.02, (sync_accuracy, accuracy)
