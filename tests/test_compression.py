"""fp16/bf16 transport: accuracy of one reduction, NaN/Inf seen by every rank, bytes halved,
LossScaleOptimizer skipping together, and digits training accuracy within 1% of float32."""

import json
import re

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def codec_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("codec")
    check(run_job(3, "compression_check.py", "codec", str(out))[0])
    return [json.loads((out / f"codec_rank{r}.json").read_text()) for r in range(3)]


def test_one_reduction_is_accurate_for_values_beyond_the_fp16_range(codec_report):
    for report in codec_report:
        for key, error in report["errors"].items():
            # fp16: 10-bit mantissa, rounded twice (reduce-scatter, all-gather); bf16: 7-bit.
            bound = 1e-3 if key.startswith("fp16") else 5e-3
            assert error <= bound, f"{key}: relative error {error:.2e}"


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_a_nan_or_inf_on_one_rank_reaches_every_rank(codec_report, compression):
    for report in codec_report:
        assert report[f"{compression}/nan"][1] == "nan"
        assert report[f"{compression}/inf"][1] == "inf"
        assert float(report[f"{compression}/nan"][0]) == pytest.approx(3.0, rel=5e-3)  # intact


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_sum_into_a_separate_buffer_without_spinning_equals_the_in_place_sum(codec_report,
                                                                           compression):
    """The same bits where the codec sums (fp16, bf16); float32's sum is MPI's own, and its
    blocking and non-blocking all-reduces may add in different orders (from 3 ranks, the
    blocking one takes the ring for 256 KiB and more: tf_poseidon/allreduce_rules.conf), so
    there each is held to float32 summation's error bound; every rank gets the same bits."""
    for report in codec_report:
        result = report[f"sum_into/{compression}"]
        assert result["is_out"] and result["payload_intact"]
        assert result["within_bound"] if compression == "none" else result["equal"]
    assert len({report[f"sum_into/{compression}"]["digest"] for report in codec_report}) == 1


def test_fp16_halves_the_bytes_on_the_wire(codec_report):
    report = codec_report[0]
    assert report["bytes/fp16"] == pytest.approx(report["bytes/none"] / 2)


def test_fp16_moves_weights_whose_gradients_are_near_float32s_smallest_normal(codec_report):
    # SGD at lr 1e34, gradients ~1e-35 (normal floats) in a bucket of their own: the fp16
    # scale is capped (codecs.MAX_SCALE) instead of overflowing to +inf, which left the
    # weights where they were.
    for report in codec_report:
        exact, fp16 = np.array(report["tiny/none"]), np.array(report["tiny/fp16"])
        assert np.all(np.abs(exact - 0.04) < 1e-3)  # two steps of 0.02
        np.testing.assert_allclose(fp16, exact, rtol=1e-3)


def test_loss_scale_optimizer_skips_the_step_on_every_rank_together(tmp_path_factory):
    single = tmp_path_factory.mktemp("ls1")
    check(run_job(0, "compression_check.py", "lossscale", str(single))[0])
    two = tmp_path_factory.mktemp("ls2")
    result, seconds = run_job(2, "compression_check.py", "lossscale", str(two), timeout=120)
    check(result)
    reference = np.load(single / "lossscale_rank0.npz")
    for rank in range(2):
        mine = np.load(two / f"lossscale_rank{rank}.npz")
        assert float(mine["scale"]) == float(reference["scale"])  # halved once, everywhere
        # fp16 transport: equal to one process up to the wire's rounding.
        assert np.max(np.abs(mine["weights"] - reference["weights"])) < 5e-3


def test_fp16_training_accuracy_is_within_one_percent_of_float32():
    accuracies = {}
    for compression in ("none", "fp16"):
        result, _ = run_job(2, "../../examples/train_digits.py", "--compression", compression,
                            "--verbose", "0")
        match = re.search(r"test accuracy: (\S+)", check(result))
        accuracies[compression] = float(match.group(1))
    assert accuracies["none"] > 0.9
    assert abs(accuracies["fp16"] - accuracies["none"]) <= 0.01, accuracies
