"""Nothing hangs and nothing is silent: a failing rank ends the job, different models are
named, and only rank 0 prints Keras' progress while every rank holds the global History;
each phase's timeout; kill drills (docs/failures.md)."""

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from multirank import WORKERS, check, job_env, run_job
from tf_poseidon import initial_sync, timeouts
from tf_poseidon.comm.engine import ENGINE_REPORT_GRACE_S, CommEngine
from tf_poseidon.comm.errors import CollectiveTimeoutError
from tf_poseidon.testing.loopback import LoopbackWorld



@pytest.mark.multirank
def test_a_rank_that_raises_ends_the_whole_job_with_its_traceback():
    result, seconds = run_job(2, "misbehave.py", "raise", timeout=120)
    assert result.returncode != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end"
    assert "[tf_poseidon rank 1] uncaught exception" in result.stdout
    assert "RuntimeError: injected failure on rank 1" in result.stdout


@pytest.mark.multirank
def test_different_models_fail_at_the_first_step_naming_the_mismatch():
    result, seconds = run_job(2, "misbehave.py", "mismatch", timeout=120)
    assert result.returncode != 0 and seconds < 60
    assert "the ranks built different models" in result.stdout
    assert re.search(r"variable 0 differs between rank 0 \(\S+: shape \(10, 16\), float32\) and "
                     r"rank 1 \(\S+: shape \(10, 24\), float32\)", result.stdout), result.stdout


# What TensorFlow's C++ runtime logs when any process imports it, whatever tf_poseidon does.
TF_IMPORT_LOG = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called"
                           r"|I\d{4} [\d:.]+ +\d+ \S+:\d+\] ")


@pytest.mark.multirank
def test_rank_0_alone_prints_progress_and_warnings_rank_1_has_the_global_history():
    result, _ = run_job(2, "misbehave.py", "verbose", mpi_args="--tag-output")
    output = check(result)
    progress = [line for line in output.split("\n") if "loss:" in line]  # bars redraw with \r
    assert progress, output
    assert all(line.startswith("[1,0]") for line in progress), progress
    alone = [line for line in output.split("\n") if "each rank trains its own copy" in line]
    assert len(alone) == 1 and alone[0].startswith("[1,0]<stderr>:"), output
    finals = re.findall(r"\[1,(\d)\]<stdout>: ?rank \d final loss (\S+)", output)
    assert sorted(rank for rank, _ in finals) == ["0", "1"], output
    assert finals[0][1] == finals[1][1]
    # fit, evaluate and predict on rank 1: no warning (auto_shard_policy, ...), no progress.
    assert "auto_shard_policy" not in output, output
    rank_1 = [re.sub(r"^\[1,1\]<std(out|err)>: ?", "", line) for line in output.split("\n")
              if line.startswith("[1,1]")]
    assert [line for line in rank_1 if not TF_IMPORT_LOG.match(line)] == \
        [f"rank 1 final loss {finals[0][1]}"], output


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["fit", "loop"])
def test_uneven_per_rank_datasets_end_the_epoch_together(how):
    # distribute_datasets_from_function with shards of 5, 7 and 9 batches: every rank stops
    # after 5 steps each epoch instead of waiting forever for the shorter shards.
    result, seconds = run_job(3, "uneven_shards.py", how, timeout=120)
    output = check(result)
    steps = re.findall(r"rank (\d) steps (\d+)", output)
    assert sorted(steps) == sorted([(str(r), "5") for r in range(3)] * 2), output


# -- timeouts by phase (tf_poseidon/timeouts.py) ---------------------------------------------

STEP_TIMEOUT_S = 3  # TF_POSEIDON_TIMEOUT of these jobs; their slow phases take longer


@pytest.mark.multirank
def test_a_hung_rank_times_out_and_the_cause_is_the_last_line():
    # Rank 1 stops for 600 s before its 4th batch; rank 0's engine waits for rank 1 to post
    # the gradients of step 3 and times out (the job ends long before the sleep would), naming
    # the step. Rank 0's own output ends with the cause in one line, once, and the launcher's
    # last line repeats it.
    result, _ = run_job(2, "misbehave.py", "hang", timeout=240, mpi_args="--tag-output",
                        env={"TF_POSEIDON_TIMEOUT": "5"})
    assert result.returncode != 0
    cause = ("CollectiveTimeoutError: this rank posted gradients step 3 (1 bucket: allreduce "
             "844 B float32) and waited 5 s for the other ranks to post theirs: a peer rank has "
             "died, hangs, or runs a different program.")
    lines = result.stdout.rstrip().split("\n")
    assert lines[-1].startswith(f"tfposeidon-run: the job failed: rank 0: {cause}"), lines[-8:]
    rank0 = [line for line in lines if line.startswith("[1,0]<")]
    causes = [i for i, line in enumerate(rank0) if "] aborting the job: " in line]
    assert len(causes) == 1, rank0[-30:]
    assert rank0[causes[0]].startswith(
        f"[1,0]<stderr>: [tf_poseidon rank 0] aborting the job: {cause}")
    # ... as rank 0's last line before Open MPI's output about the abort: its notice of the
    # abort delay tf_poseidon sets (world.OPEN_MPI_DEFAULTS), before or after its banner, which
    # Open MPI prints either through rank 0's stderr (tagged) or through prterun (untagged,
    # naming rank 0).
    delay = "Delaying for 2 seconds before aborting"
    assert sum(delay in line for line in rank0[causes[0] + 1:]) == 1, rank0[-30:]
    after = [line for line in rank0[causes[0] + 1:] if delay not in line]
    if after:
        assert "MPI_ABORT was invoked on rank 0" in after[1], rank0[-30:]
    else:
        assert "exited due to process rank 0" in result.stdout and '"abort"' in result.stdout, \
            lines[-12:]
    assert not any("] aborting the job: " in line for line in lines if line.startswith("[1,1]<"))


@pytest.mark.multirank
def test_long_waits_of_healthy_ranks_do_not_time_out():
    # Async EASGD, every wait longer than TF_POSEIDON_TIMEOUT: rank 1 reaches the first meeting
    # 5 s late and spends 5 s more on one batch (rank 0 waits at the end of fit), then rank 0
    # works alone for 5 s while rank 1 waits for its heartbeats.
    delay = 5
    result, _ = run_job(2, "slow_phases.py", "healthy", str(delay), timeout=300,
                        env={"TF_POSEIDON_TIMEOUT": str(STEP_TIMEOUT_S)})
    output = check(result)
    fit = {rank: float(s) for rank, s in re.findall(r"rank (\d) fit (\S+) s", output)}
    chief = {rank: float(s) for rank, s in re.findall(r"rank (\d) run_on_chief (\S+) s", output)}
    assert fit["0"] > delay + STEP_TIMEOUT_S, output[-3000:]
    assert chief["1"] >= delay, output[-3000:]
    assert "rank 0 done" in output and "rank 1 done" in output


@pytest.mark.parametrize("behaviour, cause", [
    ("chief-long", "rank 0 has been trying to do slow work for more than 5 s "
                   "(TF_POSEIDON_CHIEF_TIMEOUT); it is alive but has not finished."),
    ("chief-stopped", f"rank 0 was to do slow work and has sent no heartbeat for "
                      f"{STEP_TIMEOUT_S} s (TF_POSEIDON_TIMEOUT): its process is stopped or "
                      "hangs."),
])
@pytest.mark.multirank
def test_waiting_for_rank_0_ends_when_it_stops_or_works_too_long(behaviour, cause):
    # Rank 0's work would last 600 s: the other rank gives up at the chief limit (heartbeats
    # keep coming) or when the heartbeats stop (rank 0 SIGSTOPs itself).
    result, _ = run_job(2, "slow_phases.py", behaviour, timeout=240,
                        env={"TF_POSEIDON_TIMEOUT": str(STEP_TIMEOUT_S),
                             "TF_POSEIDON_CHIEF_TIMEOUT": "5"})
    assert result.returncode != 0
    last = result.stdout.rstrip().split("\n")[-1]
    assert last == f"tfposeidon-run: the job failed: rank 1: CollectiveTimeoutError: {cause}", \
        result.stdout[-3000:]


@pytest.mark.parametrize("behaviour, limit_s, cause", [
    ("exit-working", 60, None),
    ("exit-stopped", 60, f"this rank has reached the end of its program and waits for rank 0, "
                     f"which sent no heartbeat for {STEP_TIMEOUT_S} s (TF_POSEIDON_TIMEOUT): a "
                     "stopped process, or one whose Python threads cannot run."),
    ("exit-stuck", 6, "this rank has reached the end of its program and has waited 6 s "
                   "(TF_POSEIDON_MEETING_TIMEOUT) for rank 0, alive but not at the end of the "
                   "program: stuck (a deadlock, an endless loop), or working alone for longer "
                   "than that."),
])
@pytest.mark.multirank
def test_the_end_of_the_program_waits_for_a_working_rank_not_a_stuck_one(behaviour, limit_s,
                                                                         cause):
    # After a short fit rank 1 reaches the end of its program while rank 0 works alone for
    # 5 s (heartbeats: rank 1 waits past the step timeout), stops its own process (no
    # heartbeat: rank 1 gives up after the step timeout), or sleeps 600 s (heartbeats: rank 1
    # gives up at the meeting limit, TF_POSEIDON_MEETING_TIMEOUT). The cause is the launcher's
    # last line.
    delay = 5
    result, seconds = run_job(2, "slow_phases.py", behaviour, str(delay), timeout=240,
                              env={"TF_POSEIDON_TIMEOUT": str(STEP_TIMEOUT_S),
                                   "TF_POSEIDON_MEETING_TIMEOUT": str(limit_s)})
    if cause is None:
        output = check(result)
        assert "rank 0 done" in output and "rank 1 done" in output
        assert seconds > delay
        return
    assert result.returncode != 0, result.stdout[-3000:]
    last = result.stdout.rstrip().split("\n")[-1]
    assert last == f"tfposeidon-run: the job failed: rank 1: CollectiveTimeoutError: {cause}", \
        result.stdout[-3000:]
    assert seconds < 120, f"{seconds:.0f} s"


@pytest.mark.multirank
def test_work_that_fails_on_rank_0_raises_on_every_rank():
    # Rank 0's own error on rank 0; on the others, that rank 0 failed (its output says why).
    output = check(run_job(2, "slow_phases.py", "chief-fails", timeout=240)[0])
    assert "rank 0 raised ValueError: the disk is full" in output, output[-3000:]
    assert "rank 1 raised RuntimeError: rank 0 failed to do slow work; its output says why." \
        in output, output[-3000:]


def test_phase_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", "30")
    assert timeouts.step_s() == 30
    assert timeouts.broadcast_s(0) == 30
    assert timeouts.broadcast_s(2_000_000_000) == 30 + 200  # 1 s per 10 MB
    assert (timeouts.start_s(), timeouts.chief_s(), timeouts.meeting_s()) == (600, 3600, 3600)
    monkeypatch.setenv("TF_POSEIDON_CHIEF_TIMEOUT", "7200")
    assert timeouts.chief_s() == 7200
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("TF_POSEIDON_START_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"TF_POSEIDON_START_TIMEOUT='{bad}': give a "
                                             "positive number of seconds"):
            timeouts.start_s()


def test_the_initial_broadcast_waits_as_long_as_its_bytes_need(monkeypatch):
    # Two ranks in one process (loopback): both meet, then rank 1 stops before the broadcast
    # of rank 0's 20 MB of weights. With a 1 s step timeout, rank 0 gives up after
    # timeouts.broadcast_s(20 MB) = 1 s + 2 s, and says so.
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", "1")
    limit_s = timeouts.broadcast_s(20_000_000)
    assert limit_s == 3

    def rank_main(comm):
        engine = CommEngine(comm)
        weights = [tf.Variable(tf.zeros([5_000_000]))]
        if comm.rank == 1:  # the first meeting, then nothing
            engine.call(lambda c: c.allgather(initial_sync.describe(weights)),
                        label=initial_sync.FIRST_MEETING)
            return None
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as raised:
            initial_sync.check_and_broadcast(engine, weights)
        return str(raised.value), time.monotonic() - start

    message, seconds = LoopbackWorld(2, timeout_s=30).run(rank_main)[0]
    assert message == ("tf_poseidon: the initial broadcast of 20.0 MB of float32 values did not "
                       "complete within 3 s (TF_POSEIDON_TIMEOUT + 1 s per 10 MB). A peer rank "
                       "hangs or runs a different program.")
    assert limit_s <= seconds < limit_s + ENGINE_REPORT_GRACE_S, seconds


# -- kill drills: SIGKILL of a rank at four points (tests/workers/checkpoint_kill.py) ---------

KILL_BOUND_S = 60  # from the kill to the launcher's exit


def wait_for(condition, process, timeout_s: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the job ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.002)


def load_checkpoint_sums(path) -> list[float]:
    """The sums of the weights of the .keras file ``path``, loaded with the worker's module
    imported (its Tripwire layer is in the model)."""
    spec = importlib.util.spec_from_file_location("checkpoint_kill",
                                                  os.path.join(WORKERS, "checkpoint_kill.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.weight_sums(keras.models.load_model(path))


@pytest.mark.parametrize("victim, when", [(1, "forward"), (1, "collective"), (1, "save"),
                                          (0, "save")])
@pytest.mark.multirank
def test_kill_drill(tmp_path, victim, when):
    # Rank `victim` is SIGKILLed in epoch 2: in its forward pass (it kills itself), waiting in
    # the gradient all-reduce (rank 0 is 8 s late to it), or while rank 0 writes epoch 2's
    # checkpoint (134 MB). The job must end non-zero within KILL_BOUND_S, the launcher's last
    # line naming the lost rank, and the checkpoint directory must hold a complete checkpoint:
    # epoch 1's (or, when rank 0 finished its rename before it was killed too, epoch 2's).
    log = tmp_path / "log"
    args = ["--arm", when] if when != "save" else []
    args += ["--width", "4096" if when == "save" else "256"]
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_poseidon.launcher", "-np", "2", sys.executable,
         os.path.join(WORKERS, "checkpoint_kill.py"), str(tmp_path), *args],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=job_env(), cwd=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "epoch1.json").exists(), process, 300,
                 "first epoch's checkpoint", log)
        pids = [int((tmp_path / f"pid_rank{r}").read_text()) for r in (0, 1)]
        temp = tmp_path / f".tp-tmp-{pids[0]}-model.keras"
        if when == "forward":
            wait_for(lambda: (tmp_path / "killing").exists(), process, 120, "kill", log)
            killed_at = float((tmp_path / "killing").read_text())
        else:
            if when == "collective":
                wait_for(lambda: (tmp_path / "rank1_forward").exists(), process, 120,
                         "rank 1's forward pass of epoch 2", log)
                time.sleep(2)  # rank 1 is in the all-reduce; rank 0 sleeps 6 s more
                assert not (tmp_path / "epoch2.json").exists()
            else:  # epoch<e>.json is written just before epoch e's saves
                wait_for(lambda: (tmp_path / "epoch2.json").exists(), process, 120,
                         "second epoch's end", log)
                wait_for(temp.exists, process, 120, "second epoch's save", log)
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.time()
        try:
            status = process.wait(timeout=KILL_BOUND_S + 60)
        except subprocess.TimeoutExpired:
            status = None
        ended_at = time.time()
    finally:
        process.kill()
        process.wait()
        for pid in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert status is not None and status != 0, output[-4000:]
    assert ended_at - killed_at < KILL_BOUND_S, f"{ended_at - killed_at:.0f} s:\n{output[-4000:]}"
    last = output.rstrip().split("\n")[-1]
    assert re.fullmatch(rf"tfposeidon-run: the job failed: rank {victim} \(PID "
                        rf"{pids[victim]} on \S+\) died of signal 9 \(Killed\)", last), \
        output[-4000:]
    # A complete checkpoint, bit for bit the state of the epoch it names, never a torn one.
    epochs = {e: json.loads((tmp_path / f"epoch{e}.json").read_text())
              for e in (1, 2) if (tmp_path / f"epoch{e}.json").exists()}
    possible = [1, 2] if when == "save" and victim == 1 else [1]
    sums = load_checkpoint_sums(tmp_path / "model.keras")
    assert any(sums == pytest.approx(epochs[e], rel=1e-12) for e in possible if e in epochs)
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        metadata = json.load(f)
    assert metadata["epoch"] in possible
    model = keras.models.load_model(tmp_path / "model.keras")
    model.load_weights(tmp_path / "backup" / metadata["weights"])
    assert [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights] == \
        pytest.approx(epochs[metadata["epoch"]], rel=1e-12)
    print(f"rank {victim} killed at {when}: job ended {ended_at - killed_at:.1f} s later; "
          f"checkpoint and backup of epoch {metadata['epoch']}")
