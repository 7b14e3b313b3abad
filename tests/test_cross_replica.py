"""The tf.distribute API's cross-replica collectives over several real ranks, eager and traced."""

import json

import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("ranks", [2, 3])
def test_reduce_and_gather_give_every_rank_the_same_exact_answer(tmp_path, ranks):
    check(run_job(ranks, "cross_replica.py", str(tmp_path))[0])
    expected = {
        "sum_scalar": sum(r + 1.0 for r in range(ranks)),
        "mean_vector": [sum(range(ranks)) / ranks, 2.0 * sum(range(ranks)) / ranks, 3.0],
        "sum_float64": [float(sum(range(ranks)))],
        "gather_rows": [[float(r)] * 2 for r in range(ranks) for _ in range(r + 1)],
        "gather_bfloat16": [[float(r)] * 2 for r in range(ranks) for _ in range(r + 1)],
        "all_gather": [[float(r) for r in range(ranks)]],
    }
    for rank in range(ranks):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for how in ("eager", "function"):
            assert report[how] == expected, (rank, how)
