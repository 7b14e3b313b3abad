"""Nothing hangs and nothing is silent: a failing rank ends the job, different models are
named, and only rank 0 prints Keras' progress while every rank holds the global History."""

import re

import pytest

from multirank import check, run_job


def test_a_rank_that_raises_ends_the_whole_job_with_its_traceback():
    result, seconds = run_job(2, "misbehave.py", "raise", timeout=120)
    assert result.returncode != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end"
    assert "[tf_poseidon rank 1] uncaught exception" in result.stdout
    assert "RuntimeError: injected failure on rank 1" in result.stdout


def test_different_models_fail_at_the_first_step_naming_the_mismatch():
    result, seconds = run_job(2, "misbehave.py", "mismatch", timeout=120)
    assert result.returncode != 0 and seconds < 60
    assert "the ranks built different models" in result.stdout
    assert re.search(r"variable 0 differs between rank 0 \(\S+: shape \(10, 16\), float32\) and "
                     r"rank 1 \(\S+: shape \(10, 24\), float32\)", result.stdout), result.stdout


# What TensorFlow's C++ runtime logs when any process imports it, whatever tf_poseidon does.
TF_IMPORT_LOG = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called"
                           r"|I\d{4} [\d:.]+ +\d+ \S+:\d+\] ")


def test_progress_on_rank_0_only_rank_1_prints_nothing_else_and_has_the_global_history():
    result, _ = run_job(2, "misbehave.py", "verbose", mpi_args="--tag-output")
    output = check(result)
    progress = [line for line in output.split("\n") if "loss:" in line]  # bars redraw with \r
    assert progress, output
    assert all(line.startswith("[1,0]") for line in progress), progress
    finals = re.findall(r"\[1,(\d)\]<stdout>: ?rank \d final loss (\S+)", output)
    assert sorted(rank for rank, _ in finals) == ["0", "1"], output
    assert finals[0][1] == finals[1][1]
    # fit, evaluate and predict on rank 1: no warning (auto_shard_policy, ...), no progress.
    assert "auto_shard_policy" not in output, output
    rank_1 = [re.sub(r"^\[1,1\]<std(out|err)>: ?", "", line) for line in output.split("\n")
              if line.startswith("[1,1]")]
    assert [line for line in rank_1 if not TF_IMPORT_LOG.match(line)] == \
        [f"rank 1 final loss {finals[0][1]}"], output


@pytest.mark.parametrize("how", ["fit", "loop"])
def test_uneven_per_rank_datasets_end_the_epoch_together(how):
    # distribute_datasets_from_function with shards of 5, 7 and 9 batches: every rank stops
    # after 5 steps each epoch instead of waiting forever for the shorter shards.
    result, seconds = run_job(3, "uneven_shards.py", how, timeout=120)
    output = check(result)
    steps = re.findall(r"rank (\d) steps (\d+)", output)
    assert sorted(steps) == sorted([(str(r), "5") for r in range(3)] * 2), output
