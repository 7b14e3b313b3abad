"""Wait-free backprop: bucketed collectives, overlap on/off, statistics and timeline, and the
Keras features that touch the gradient path (steps_per_execution, clipping, no-gradient
variables). Real 2-rank jobs of tests/workers/dwbp_features.py, against one plain process."""

import json

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank

SMALL_BUCKETS = ["--bucket-bytes", "100000"]  # 3 buckets for this model


def train(tmp_path_factory, num_ranks, *args):
    out = tmp_path_factory.mktemp("dwbp")
    check(run_job(num_ranks, "dwbp_features.py", str(out), *args)[0])
    return out


def weights(out, rank=0, feature="plain"):
    return np.load(out / f"{feature}_rank{rank}.npz")["weights"]


def max_difference(a, b):
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    return train(tmp_path_factory, 2, *SMALL_BUCKETS, "--timeline", "TIMELINE")


def test_overlap_and_no_overlap_give_the_same_weights(tmp_path_factory, overlapped):
    naive = train(tmp_path_factory, 2, *SMALL_BUCKETS, "--no-overlap")
    for rank in range(2):  # 22 steps
        assert max_difference(weights(overlapped, rank), weights(naive, rank)) <= 1e-6


def test_stats_report_buckets_layers_bytes_and_times(overlapped):
    stats = json.loads((overlapped / "plain_stats_rank0.json").read_text())
    assert len(stats["steps"]) == 22
    step = stats["steps"][-1]
    assert [b["index"] for b in step["buckets"]] == [0, 1, 2]
    # Backprop order: the logits layer is in bucket 0, the first layer in the last bucket.
    assert "logits/kernel" in step["buckets"][0]["layers"]
    assert "wide1/kernel" in step["buckets"][-1]["layers"]
    # Ring all-reduce at P=2 sends and receives the payload once: 4 bytes per float32.
    assert stats["per_layer"]["wide2/kernel"]["bytes_sent"] == 256 * 256 * 4
    parameters = 32 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert step["bytes_sent"] == step["bytes_received"] == (parameters + 1) * 4
    summary = stats["summary"]
    assert summary["step_time_s"] > 0 and summary["comm_time_s"] > 0
    assert 0 <= summary["overlapped_s"] <= summary["comm_time_s"]
    assert 0 <= summary["hidden_fraction"] <= 1


def test_timeline_is_a_chrome_trace_with_every_rank_and_bucket(overlapped):
    trace = json.loads((overlapped / "TIMELINE").read_text())  # written by rank 0 at exit
    events = trace["traceEvents"]
    gradient_events = [e for e in events if e.get("cat") == "gradients"]
    assert {e["pid"] for e in gradient_events} == {0, 1}
    assert {e["args"]["bucket"] for e in gradient_events} == {0, 1, 2}
    assert len(gradient_events) == 2 * 22 * 3
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] > 0 for e in gradient_events)
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}


KERAS_FEATURES = ["steps_per_execution", "clipnorm", "global_clipnorm", "no_gradient_variable"]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """World size (0: one plain process) -> the output of one job that fits once per feature."""
    every = ["--features", ",".join(KERAS_FEATURES)]
    return {0: train(tmp_path_factory, 0, *every),
            2: train(tmp_path_factory, 2, *SMALL_BUCKETS, *every)}


@pytest.mark.parametrize("feature", KERAS_FEATURES)
def test_keras_gradient_features_match_one_process(features, feature):
    # Clipping sees the reduced gradient (as one process clips the whole batch's gradient).
    for rank in range(2):
        assert max_difference(weights(features[0], feature=feature),
                              weights(features[2], rank, feature)) <= 1e-5
