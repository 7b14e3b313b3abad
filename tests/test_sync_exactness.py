"""Sync mode is exact: P ranks at global batch B give one process's weights at batch B.

Real jobs: tests/workers/train_configs.py trains each configuration under tfposeidon-run with
P = 2 and 3 and as a plain process (one job per world size, its runs one after another),
every rank seeded differently (so rank 0's initial values must reach the others). The data
set size is not a multiple of B: the last global batch is short and split unevenly (or, at
P=3 with a 1-row remainder, leaves two ranks with no rows).
tests/workers/datapath_train.py trains with buckets packed on the host and on the device
(comm/datapath.py), which must give the same bits.
"""

import json

import numpy as np
import pytest

from multirank import check, run_job, runs_by_world_size

pytestmark = pytest.mark.multirank

FIT_CONFIGS = "mlp-sgd,mlp-adam,cnn-sgd,cnn-adam,penalties-sgd"
LOOP_CONFIGS = {"distribute_dataset": ["mlp-sgd@loop", "cnn-adam@loop"],
                "datasets_from_function": ["mlp-sgd@function", "cnn-adam@function"]}
FIT = f"--configs {FIT_CONFIGS} --rows 965"
# 961 = 16·60 + 1: at P=3 the last global batch gives ranks 0 and 1 no rows at all.
NO_ROWS = "--configs mlp-sgd,penalties-sgd --rows 961"
LOOPS = f"--configs {','.join(sum(LOOP_CONFIGS.values(), []))} --rows 965"
# Random layers in a custom loop: 960 rows, every rank's share of every batch the same.
DRAWS = "--configs dropout-sgd@loop --rows 960"
RUNS = {  # world size (0: one plain process) -> run -> train_configs.py's arguments
    0: {"fit": FIT, "no_rows": NO_ROWS, "loops": LOOPS, "draws": DRAWS},
    2: {"fit": FIT, "autotune": f"{FIT} --strategy '{json.dumps({'autotune': True})}'"},
    3: {"fit": FIT, "no_rows": NO_ROWS, "loops": LOOPS, "draws": DRAWS},
}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(world size, run name) -> the run's output directory (multirank.runs_by_world_size)."""
    return runs_by_world_size(tmp_path_factory, "train_configs.py", RUNS)


def load(out, config, rank):
    return np.load(out / f"{config}_rank{rank}.npz")


def assert_same(reference, other, keys):
    for key in keys:
        difference = float(np.max(np.abs(reference[key] - other[key])))
        assert difference <= TOLERANCE, f"{key}: max |difference| {difference:.3g}"


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_fit_matches_one_process(runs, num_ranks):
    out = runs(num_ranks, "fit")
    for config in FIT_CONFIGS.split(","):
        reference = load(runs(0, "fit"), config, 0)
        assert len(reference["loss"]) == 2  # 2 epochs of 17 steps: 34 steps
        for rank in range(num_ranks):
            # Weights and optimizer state; the global loss/accuracy every rank's History holds;
            # evaluate's global metrics; predict's rows for the whole input, in input order.
            assert_same(reference, load(out, config, rank),
                        ["weights", "optimizer", "loss", "accuracy", "evaluation",
                         "predictions"])


def test_fit_with_autotune_matches_one_process(runs):
    # The trials (overlap on and off) take the first 8 of each model's 34 steps; the sums are
    # the same whichever setting runs a step.
    out = runs(2, "autotune")
    for rank in range(2):
        mode = json.loads((out / f"stats_rank{rank}.json").read_text())
        assert len(mode["autotune"]) == 2  # one bucket layout per model (MLP, CNN)
        for trials in mode["autotune"]:
            assert trials["state"] == "chosen", trials
            assert {c["setting"] for c in trials["candidates"]} == {
                "overlap on, codec none", "overlap off, codec none"}
    for config in FIT_CONFIGS.split(","):
        for rank in range(2):
            assert_same(load(runs(0, "fit"), config, 0), load(out, config, rank),
                        ["weights", "optimizer", "loss", "accuracy", "evaluation",
                         "predictions"])


def test_fit_with_ranks_left_without_rows(runs):
    # penalties: a loss a layer adds as a mean over the rows is NaN on a rank without rows.
    for config in NO_ROWS.split()[1].split(","):
        for rank in range(3):
            assert_same(load(runs(0, "no_rows"), config, 0),
                        load(runs(3, "no_rows"), config, rank),
                        ["weights", "loss", "accuracy", "evaluation", "predictions"])


@pytest.mark.parametrize("source", list(LOOP_CONFIGS))
def test_custom_loop_matches_one_process(runs, source):
    for config in LOOP_CONFIGS[source]:
        for rank in range(3):
            # strategy.run + GradientTape + apply_gradients; strategy.reduce of the loss.
            assert_same(load(runs(0, "loops"), config, 0), load(runs(3, "loops"), config, rank),
                        ["weights", "loss"])


def test_custom_loop_random_layers_draw_one_process_values(runs):
    # Dropout and GaussianNoise under strategy.run: each rank draws its rows of one process's
    # draw for the global batch (a window assumed from its own rows: exact when the ranks'
    # shares are equal, as here).
    for rank in range(3):
        assert_same(load(runs(0, "draws"), "dropout-sgd@loop", 0),
                    load(runs(3, "draws"), "dropout-sgd@loop", rank), ["weights", "loss"])


def test_buckets_packed_on_the_device_give_the_host_paths_weights_bit_for_bit(tmp_path):
    # tests/workers/datapath_train.py: per configuration, fit with TF_POSEIDON_DEVICE_PACK=0
    # and =1 (the device path's code with the CPU kernels), a bfloat16 and float32 layers in
    # small buckets, an unevenly split last batch (batch-share weighting).
    check(run_job(2, "datapath_train.py", str(tmp_path))[0])
    for rank in range(2):
        weights = np.load(tmp_path / f"datapath_rank{rank}.npz")
        packs = json.loads((tmp_path / f"datapath_rank{rank}.json").read_text())
        for config in ("none", "bf16", "fp16", "none-no-overlap"):
            traced = packs[f"{config}/1"]  # gradients' buckets, and the metrics' (float32)
            assert packs[f"{config}/0"] == [] and len(traced) > 1
            if config == "bf16":
                assert "bfloat16" in traced  # the cast fused into the pack
            else:
                assert set(traced) == {"float32"}  # fp16: scaled and cast on the host
            assert weights[f"{config}/1"].tobytes() == weights[f"{config}/0"].tobytes(), config
            other = np.load(tmp_path / f"datapath_rank{1 - rank}.npz")
            assert weights[f"{config}/1"].tobytes() == other[f"{config}/1"].tobytes()
