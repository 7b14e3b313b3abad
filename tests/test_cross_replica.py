"""The tf.distribute API's cross-replica collectives over several real ranks, eager and traced,
and predict for outputs whose shapes vary per batch and for ragged inputs and outputs."""

import json

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank

PREDICT_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("p1")
    check(run_job(0, "cross_replica.py", str(out))[0])
    return np.load(out / "predict_rank0.npz")


@pytest.mark.parametrize("ranks", [2, 3])
def test_reduce_and_gather_give_every_rank_the_same_exact_answer(tmp_path, one_process, ranks):
    check(run_job(ranks, "cross_replica.py", str(tmp_path))[0])
    expected = {
        "sum_scalar": sum(r + 1.0 for r in range(ranks)),
        "mean_vector": [sum(range(ranks)) / ranks, 2.0 * sum(range(ranks)) / ranks, 3.0],
        "sum_float64": [float(sum(range(ranks)))],
        "gather_rows": [[float(r)] * 2 for r in range(ranks) for _ in range(r + 1)],
        "gather_bfloat16": [[float(r)] * 2 for r in range(ranks) for _ in range(r + 1)],
        "gather_unknown_width": [[float(r)] * 3 for r in range(ranks) for _ in range(r + 1)],
        "all_gather": [[float(r) for r in range(ranks)]],
    }
    for rank in range(ranks):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # all_gather's gradient, as TensorFlow's: a rank's rows get the sum over ranks of the
        # gathered tensor's gradients at their places (rank q's loss weights row i by
        # (q + 1)·(i + 1) and (q + 1)·10·(i + 1); rank r's r + 1 rows follow the lower ranks').
        first, ranks_weight = rank * (rank + 1) // 2, ranks * (ranks + 1) // 2
        gradient = [[ranks_weight * (i + 1.0), ranks_weight * 10.0 * (i + 1)]
                    for i in range(first, first + rank + 1)]
        for how in ("eager", "function"):
            mismatch = report[how].pop("width_mismatch")
            assert "differ in a dimension other than the gathered axis" in mismatch, (rank, how)
            for axis in (0, 1):
                assert report[how].pop(f"all_gather_gradient_axis{axis}") == gradient, (
                    rank, how, axis)
            assert report[how] == expected, (rank, how)
        # predict returns every sample in input order, as one process does: per-batch time
        # steps concatenated ragged-ly, ragged inputs split across ranks, ragged outputs.
        predicted = np.load(tmp_path / f"predict_rank{rank}.npz")
        assert sorted(predicted.files) == sorted(one_process.files)
        assert one_process["sequences_lengths0"].tolist() == [5] * 12 + [9] * 12 + [4] * 5
        assert len(one_process["ragged_in"]) == 23
        for key in one_process.files:
            assert predicted[key].shape == one_process[key].shape, (rank, key)
            difference = float(np.max(np.abs(predicted[key] - one_process[key]), initial=0))
            assert difference <= PREDICT_TOLERANCE, (rank, key, difference)
