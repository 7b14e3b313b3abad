"""The seams are open: a codec and an algorithm defined outside tf_poseidon train at P=2.

The worker (tests/workers/extension_points.py) holds docs/architecture.md's worked examples —
an 8-bit min/max codec and local SGD with periodic averaging — defined in the worker itself,
with no edit inside the package; the keyword form reaches the registered algorithm by name.
"""

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def p2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ext")
    check(run_job(2, "extension_points.py", str(out))[0])
    return [np.load(out / f"ext_rank{r}.npz") for r in range(2)]


def test_a_codec_from_outside_the_package_trains_like_float32(p2):
    for rank in p2:
        loss = rank["minmax8/loss"]
        assert loss[-1] < 0.7 * loss[0]
        # 8 bits of each value on the wire: about a quarter of float32's bytes.
        assert rank["minmax8/bytes"] < 0.3 * rank["fp32/bytes"]
        # Every epoch's loss within 5% of float32's (the weights themselves wander further,
        # along directions the loss hardly sees: 8 bits of noise per step for 60 steps).
        np.testing.assert_allclose(loss, rank["fp32/loss"], rtol=0.05)
    # Every rank decodes the same bytes: the replicas stay identical.
    np.testing.assert_array_equal(p2[0]["minmax8/weights"], p2[1]["minmax8/weights"])


@pytest.mark.parametrize("case", ["local_sgd", "local_sgd_by_name"])
def test_an_algorithm_from_outside_the_package_trains(p2, case):
    assert str(p2[0][f"{case}/algorithm"]) == "LocalSGD(period=4)"
    for rank in p2:
        loss = rank[f"{case}/loss"]
        assert loss[-1] < 0.7 * loss[0]
    # 60 steps, a multiple of the period: the last step averaged the replicas.
    np.testing.assert_allclose(p2[0][f"{case}/weights"], p2[1][f"{case}/weights"], atol=1e-6)
    # ... which local steps in between made different: not sync mode under another name.
    assert np.max(np.abs(p2[0][f"{case}/weights"] - p2[0]["fp32/weights"])) > 1e-3
    np.testing.assert_array_equal(p2[0]["local_sgd/weights"], p2[0]["local_sgd_by_name/weights"])
