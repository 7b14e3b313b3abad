"""tp.callbacks: rank 0 writes, atomically; a backup resumes exactly, at any number of ranks.

Real jobs (tests/workers/checkpoint_train.py). One P=2 job trains the reference run (4 epochs
with ModelCheckpoints, a BackupAndRestore, and Keras' CSVLogger, which runs on rank 0 only;
Keras' own ModelCheckpoint is refused first; then every rank calls Keras' ``model.save``,
``save_weights`` and ``export``, which rank 0 alone writes), then a second run that every rank
SIGKILLs after epoch 2; copies of its backup are resumed at P=1 (no launcher) and P=3, and
must end with the reference's weights and optimizer state. Checkpoint files are
loaded here, in a process that did not write them. SIGKILLs mid-save: the kill drills of
tests/test_failures_and_logging.py. Automatic restarts (``tfposeidon-run --max-restarts``):
after a lost rank, with and without a backup, and on fewer hosts (``--min-np``, on an
emulated cluster).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

from multirank import WORKERS, check, job_env, run_job
from tf_poseidon import callbacks as tp_callbacks
from tf_poseidon.testing import EmulatedCluster, available

EPOCHS, INTERRUPT_AFTER = 4, 2
TOLERANCE = 1e-5


def max_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The P=2 job: reference run, then a run killed after epoch INTERRUPT_AFTER."""
    out = tmp_path_factory.mktemp("interrupted")
    result, _ = run_job(2, "checkpoint_train.py", str(out), "--reference",
                        "--backup", str(out / "backup"),
                        "--interrupt-after", str(INTERRUPT_AFTER))
    assert result.returncode != 0, "the interrupted run was meant to be killed"
    assert "signal 9" in result.stdout, result.stdout[-3000:]
    return out


@pytest.mark.multirank
def test_only_rank0_writes_checkpoints(interrupted):
    rank0, rank1 = interrupted / "rank0", interrupted / "rank1"
    assert sorted(os.listdir(rank0 / "ckpt")) == [f"epoch{e}.weights.h5"
                                                  for e in range(1, EPOCHS + 1)]
    assert (rank0 / "best.keras").is_file()
    assert not (rank0 / "backup").exists(), "BackupAndRestore deletes its backup after fit"
    assert (rank0 / "log.csv").is_file()
    assert (rank0 / "final.keras").is_file() and (rank0 / "final.weights.h5").is_file()
    assert (rank0 / "final_saved_model" / "saved_model.pb").is_file()
    # Rank 1 wrote nothing: neither with its CSVLogger nor with model.save or save_weights.
    assert os.listdir(rank1) == [], "rank 1 wrote files"
    assert not [n for n in os.listdir(rank0) if n.startswith(".tp-tmp-")]


@pytest.mark.multirank
def test_keras_csv_logger_on_rank0_logs_the_global_loss(interrupted):
    with open(interrupted / "rank0" / "log.csv") as f:
        rows = f.read().splitlines()
    assert rows[0].startswith("epoch,loss,") and len(rows) == 1 + EPOCHS, rows
    reference = np.load(interrupted / "reference_rank0.npz")["loss"]
    assert max_difference([float(r.split(",")[1]) for r in rows[1:]], reference) <= 1e-6


@pytest.mark.multirank
def test_keras_own_checkpoint_callback_is_refused_naming_ours(interrupted):
    for rank in range(2):
        message = (interrupted / f"refused_rank{rank}.txt").read_text()
        assert message.startswith("tf_poseidon: keras.callbacks.ModelCheckpoint in a "
                                  "multi-rank fit"), message
        assert "Use tp.callbacks.ModelCheckpoint, which takes the same arguments" in message


def test_which_keras_callbacks_a_multi_rank_fit_runs_on_each_rank(tmp_path):
    logs = [keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
            keras.callbacks.TensorBoard(str(tmp_path / "tensorboard"))]
    others = [keras.callbacks.EarlyStopping(), tp_callbacks.ModelCheckpoint("a.keras"),
              tp_callbacks.BackupAndRestore(str(tmp_path / "backup"))]
    assert tp_callbacks.for_this_rank(logs + others, 0) == logs + others
    assert tp_callbacks.for_this_rank(logs + others, 1) == others

    class Mine(keras.callbacks.BackupAndRestore):
        pass
    with pytest.raises(ValueError, match=r"^tf_poseidon: test_which_keras_callbacks_a_multi_rank_"
                                         r"fit_runs_on_each_rank.<locals>.Mine \(a keras\.callba"
                                         r"cks\.BackupAndRestore\) in a multi-rank fit"):
        tp_callbacks.for_this_rank(others + [Mine(str(tmp_path / "mine"))], 1)


@pytest.mark.multirank
def test_checkpoints_hold_the_final_state(interrupted):
    reference = np.load(interrupted / "reference_rank0.npz")
    assert all(np.diff(reference["loss"]) < 0)  # so best.keras is the last epoch's model
    model = keras.models.load_model(interrupted / "rank0" / "best.keras")
    weights = np.concatenate([v.numpy().ravel() for v in model.weights])
    optimizer = np.concatenate([np.ravel(v.numpy()) for v in model.optimizer.variables])
    assert max_difference(weights, reference["weights"]) == 0
    assert max_difference(optimizer, reference["optimizer"]) == 0
    for epoch in range(1, EPOCHS + 1):  # each loads; the last is the final state
        model.load_weights(interrupted / "rank0" / "ckpt" / f"epoch{epoch}.weights.h5")
    assert max_difference(np.concatenate([v.numpy().ravel() for v in model.weights]),
                          reference["weights"]) == 0
    # Keras' own model.save and save_weights, called by every rank after fit: rank 0 wrote.
    saved = keras.models.load_model(interrupted / "rank0" / "final.keras")
    assert max_difference(np.concatenate([v.numpy().ravel() for v in saved.weights]),
                          reference["weights"]) == 0
    saved.load_weights(interrupted / "rank0" / "final.weights.h5")
    assert max_difference(np.concatenate([np.ravel(v.numpy()) for v in saved.optimizer.variables]),
                          reference["optimizer"]) == 0


@pytest.mark.multirank
def test_backup_is_committed_before_any_rank_goes_on(interrupted):
    backup = interrupted / "backup"
    with open(backup / "training_metadata.json") as f:
        metadata = json.load(f)
    assert metadata["epoch"] == INTERRUPT_AFTER
    # Only the committed files are left (earlier ones are removed after each commit).
    assert sorted(os.listdir(backup)) == sorted([metadata["weights"], metadata["state"],
                                                 "training_metadata.json"])


@pytest.mark.multirank
@pytest.mark.parametrize("num_ranks", [0, 3], ids=["P=1", "P=3"])
def test_resume_matches_uninterrupted_run(tmp_path, interrupted, num_ranks):
    backup = tmp_path / "backup"
    shutil.copytree(interrupted / "backup", backup)  # resuming deletes it at the end
    check(run_job(num_ranks, "checkpoint_train.py", str(tmp_path), "--backup", str(backup))[0])
    reference = np.load(interrupted / "reference_rank0.npz")
    for rank in range(max(num_ranks, 1)):
        resumed = np.load(tmp_path / f"resumed_rank{rank}.npz")
        assert len(resumed["loss"]) == EPOCHS - INTERRUPT_AFTER
        assert max_difference(resumed["loss"], reference["loss"][INTERRUPT_AFTER:]) <= TOLERANCE
        assert max_difference(resumed["weights"], reference["weights"]) <= TOLERANCE
        assert max_difference(resumed["optimizer"], reference["optimizer"]) <= TOLERANCE
    assert not backup.exists()


@pytest.mark.multirank
def test_a_custom_loops_tensorflow_checkpoints_are_written_by_rank0_for_every_rank(tmp_path):
    # Before rank 0 wrote them (and tf.saved_model.save's variables) alone, ranks writing one
    # prefix at once deleted each other's temporary files: "MergeV2Checkpoints ... did not
    # exist" within a few saves.
    check(run_job(3, "tf_checkpoint.py", str(tmp_path))[0])
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert reports[1] == reports[0] and reports[2] == reports[0]
    prefix = str(tmp_path / "managed" / "ckpt")
    assert reports[0]["saved"] == [f"{prefix}-{n}" for n in range(1, 13)]
    assert reports[0]["latest"] == f"{prefix}-12"
    assert reports[0]["checkpoints"] == [f"{prefix}-11", f"{prefix}-12"]
    assert reports[0]["save_counter"] == 12 and reports[0]["written"] == str(tmp_path / "final")
    assert re.match(r"tf_poseidon: asynchronous checkpoints .* are not supported",
                    reports[0]["async_refused"])
    assert sorted(os.listdir(tmp_path / "managed")) == [
        "checkpoint", *(f"ckpt-{n}.{part}" for n in (11, 12)
                        for part in ("data-00000-of-00001", "index"))]
    assert not list(tmp_path.glob("async*"))
    trained = [np.load(tmp_path / f"rank{r}.npz") for r in range(3)]
    for r in (1, 2):
        assert all(np.array_equal(trained[0][k], trained[r][k]) for k in trained[0].files)
    check(run_job(0, "tf_checkpoint.py", str(tmp_path), "--restore")[0])
    restored = json.loads((tmp_path / "restored.json").read_text())
    assert restored.pop("saved_model") < 1e-6, restored
    assert restored == {"final": 0.0, "final save_counter": 12, "latest": 0.0,
                        "latest save_counter": 12}


def launch_with_restart(launcher_args, worker_args, cwd, mpi_args="", run=None) -> str:
    """Output of ``tfposeidon-run --max-restarts 1 LAUNCHER_ARGS python checkpoint_train.py
    WORKER_ARGS`` (stdout and stderr merged); fails the test if the job does not end with 0.
    ``run(argv)`` starts it (default: here, as a subprocess)."""
    argv = [sys.executable, "-m", "tf_poseidon.launcher", "--max-restarts", "1", *launcher_args,
            *([f"--mpi-args={mpi_args}"] if mpi_args else []),
            sys.executable, os.path.join(WORKERS, "checkpoint_train.py"), *worker_args]
    if run is None:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=job_env(), timeout=600, cwd=cwd)
        done.stdout = done.stdout.decode("utf-8", errors="replace")
    else:
        done = run(argv)
    return check(done)


def assert_restarted(output: str) -> None:
    """The launcher's last words about the first launch: rank 1 was killed; then the restart."""
    assert re.search(r"tfposeidon-run: the job failed: rank 1 \(PID \d+ on \S+\) died of "
                     r"signal 9 \(Killed\)\ntfposeidon-run: restarting the job \(restart 1 of 1, "
                     r"2 ranks\) after exit status \d+\n", output), output[-4000:]


FROM_SCRATCH = ("tf_poseidon: restart 1 of the job (TF_POSEIDON_RESTART=1), and no "
                "tp.callbacks.BackupAndRestore restored a backup: training starts from the "
                "beginning")


@pytest.mark.multirank
def test_restart_after_a_lost_rank_resumes_exactly(tmp_path):
    # Backups every 5 batches (12 per epoch, 4 epochs, a Dropout layer); rank 1 is SIGKILLed
    # before epoch 3's 9th batch on the first launch. tfposeidon-run --max-restarts 1 starts the
    # job again, which resumes after 6 batches of epoch 3 (the last backup) and must end like
    # an uninterrupted run: weights, optimizer state and the last two epochs' losses.
    args = ["--save-freq", "5", "--dropout"]
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    check(run_job(2, "checkpoint_train.py", str(reference), "--backup",
                  str(reference / "backup"), *args)[0])
    output = launch_with_restart(["-np", "2"], [str(restarted), "--backup",
                                                str(restarted / "backup"), *args,
                                                "--kill-rank1-at", "3:9"], tmp_path)
    assert_restarted(output)
    assert output.count("tf_poseidon BackupAndRestore: resuming at epoch 3, after 6 of its "
                        "steps, from ") == 1, output[-4000:]
    assert FROM_SCRATCH not in output
    assert_resumed_like(reference, restarted, ranks=2)


def assert_resumed_like(reference, restarted, ranks: int) -> None:
    """Every rank of the restarted run ended with the weights, optimizer state and last two
    epochs' losses of the uninterrupted reference, and the backup is gone."""
    expected = np.load(reference / "resumed_rank0.npz")
    for rank in range(ranks):
        got = np.load(restarted / f"resumed_rank{rank}.npz")
        assert max_difference(got["weights"], expected["weights"]) <= TOLERANCE
        assert max_difference(got["optimizer"], expected["optimizer"]) <= TOLERANCE
        assert len(got["loss"]) == 2
        assert max_difference(got["loss"], expected["loss"][2:]) <= TOLERANCE
    assert not (restarted / "backup").exists()


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    """Rank 0's npz of an uninterrupted P=2 run of ``checkpoint_train.py --plain``."""
    out = tmp_path_factory.mktemp("plain")
    check(run_job(2, "checkpoint_train.py", str(out), "--plain")[0])
    return np.load(out / "plain_rank0.npz")


@pytest.mark.multirank
@pytest.mark.parametrize("backup", [False, True], ids=["no BackupAndRestore", "no backup yet"])
def test_a_restart_that_cannot_resume_says_it_starts_from_the_beginning(tmp_path, backup,
                                                                       plain_reference):
    # Rank 1 is SIGKILLed before the 3rd batch of epoch 1, when a BackupAndRestore has no
    # backup yet, or in a fit without one. The restarted job trains its 4 epochs again from the
    # model's initial weights (it ends like an uninterrupted run), and rank 0 says so, once:
    # BackupAndRestore when it finds no backup, else the first broadcast of rank 0's weights.
    restarted = tmp_path / "restarted"
    how = ["--backup", str(restarted / "backup")] if backup else ["--plain"]
    output = launch_with_restart(["-np", "2"], [str(restarted), *how, "--kill-rank1-at", "1:3"],
                                 tmp_path, mpi_args="--tag-output")
    assert_restarted(output)
    said = (f"[1,0]<stdout>: tf_poseidon BackupAndRestore: restart 1 of the job but no backup "
            f"in {restarted / 'backup'}: training starts from the beginning." if backup else
            f"[1,0]<stderr>: {FROM_SCRATCH}")
    lines = output.split("\n")
    assert [line for line in lines if "training starts from the beginning" in line] == \
        [line for line in lines if line.startswith(said)], output[-4000:]
    assert output.count(said) == 1, output[-4000:]
    assert output.index(said) > output.index("tfposeidon-run: restarting the job")
    for rank in (0, 1):
        got = np.load(restarted / f"{'resumed' if backup else 'plain'}_rank{rank}.npz")
        assert len(got["loss"]) == EPOCHS
        assert max_difference(got["loss"], plain_reference["loss"]) <= TOLERANCE
        assert max_difference(got["weights"], plain_reference["weights"]) <= TOLERANCE


@pytest.mark.cluster
@pytest.mark.multirank
def test_min_np_restart_resumes_on_the_hosts_left(tmp_path):
    # Three emulated hosts, one rank each; backups every 5 batches. Before epoch 3's 9th batch
    # rank 1 dies with its host: it marks host1 lost (the rsh agent refuses it from then on)
    # and SIGKILLs itself. tfposeidon-run --max-restarts 1 --min-np 2 checks the hosts again,
    # leaves host1 out and restarts on host0 and host2: 2 ranks, which resume after 6 batches
    # of epoch 3 and end like an uninterrupted run (sync training without randomness does not
    # depend on the number of ranks). Open MPI reports the lost rank in one of two ways
    # (test_multihost.py), so only the hosts left and the restart are checked here.
    ok, why = available()
    if not ok:
        pytest.skip(why)
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    check(run_job(2, "checkpoint_train.py", str(reference), "--backup",
                  str(reference / "backup"), "--save-freq", "5")[0])
    marker = tmp_path / "host1-lost"
    with EmulatedCluster(3, None) as cluster:
        agent = tmp_path / "agent.sh"
        agent.write_text(f'#!/bin/sh\nif [ "$1" = host1 ] && [ -e {marker} ]; then\n'
                         '  echo "ssh: connect to host host1 port 22: No route to host" >&2\n'
                         f'  exit 255\nfi\nexec {cluster.agent} "$@"\n')
        agent.chmod(0o755)

        def on_host0(argv):
            done = cluster.run(argv, env=job_env(), timeout=600)
            done.stdout += done.stderr  # the launcher's own lines are all on stderr
            return done
        output = launch_with_restart(
            ["-np", "3", "-H", "host0:1,host1:1,host2:1", "--min-np", "2",
             "--network-interfaces", "eth0"],
            [str(restarted), "--backup", str(restarted / "backup"), "--save-freq", "5",
             "--kill-rank1-at", "3:9", "--lost-marker", str(marker)], tmp_path,
            mpi_args=f"--mca plm_rsh_agent {agent}", run=on_host0)
    assert re.search(r"tfposeidon-run: host1: .* failed with exit 255: ssh: connect to host "
                     r"host1 port 22: No route to host\ntfposeidon-run: restarting the job "
                     r"\(restart 1 of 1, 2 ranks\) after exit status \d+\n", output), \
        output[-4000:]
    assert output.count("tf_poseidon BackupAndRestore: resuming at epoch 3, after 6 of its "
                        "steps, from ") == 1, output[-4000:]
    assert_resumed_like(reference, restarted, ranks=2)


@pytest.mark.multirank
def test_example_trains_resumes_and_exports(tmp_path):
    # One process each (the multi-rank behaviour is tested above); the example's own logic:
    # checkpoints, --resume from the latest, exports numbered 1, 2.
    example = os.path.join(os.path.dirname(WORKERS), os.pardir, "examples",
                           "train_checkpoint_export.py")
    first = check(run_job(0, example, "--epochs", "1", "--verbose", "0", cwd=str(tmp_path))[0])
    assert "exported to digits_output/export/1" in first
    second = check(run_job(0, example, "--epochs", "2", "--resume", "--verbose", "0",
                           cwd=str(tmp_path))[0])
    assert "resuming from digits_output/checkpoints/epoch01.keras on 1 rank(s)" in second
    assert "after 2 epochs; exported to digits_output/export/2" in second
    assert os.listdir(tmp_path) == ["digits_output"]  # nothing else in the working directory
    assert sorted(os.listdir(tmp_path / "digits_output" / "checkpoints")) == \
        ["epoch01.keras", "epoch02.keras"]



# -- one process, plain Keras (no strategy) ---------------------------------------------------

class Interrupted(Exception):
    pass


class InterruptAfter(keras.callbacks.Callback):
    def __init__(self, epochs: int):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            raise Interrupted()


class InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.epoch, self.batch, self.current = epoch, batch, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current, batch) == (self.epoch, self.batch):
            raise Interrupted()


def plain_fit(callbacks, epochs=5, dropout=False) -> tuple[keras.Model, list]:
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    layers = [keras.layers.Dense(8), keras.layers.Dropout(0.5)] if dropout else []
    model = keras.Sequential([keras.Input((4,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=epochs, shuffle=False,
                        callbacks=callbacks, verbose=0)
    return model, history.history["loss"]


def test_plain_keras_double_checkpoint_falls_back_to_previous(tmp_path):
    backup = tmp_path / "backup"
    with pytest.raises(Interrupted):
        plain_fit([tp_callbacks.BackupAndRestore(str(backup), double_checkpoint=True),
                   InterruptAfter(3)])
    with open(backup / "training_metadata.json") as f:
        metadata = json.load(f)
    assert (metadata["epoch"], metadata["previous"]["epoch"]) == (3, 2)
    assert sorted(os.listdir(backup)) == sorted([metadata["weights"], metadata["state"],
                                                 metadata["previous"]["weights"],
                                                 metadata["previous"]["state"],
                                                 "training_metadata.json"])
    (backup / metadata["weights"]).write_bytes(b"lost to a disk error")
    resumed, losses = plain_fit([tp_callbacks.BackupAndRestore(str(backup),
                                                               double_checkpoint=True)])
    assert len(losses) == 3  # restarted after epoch 2, from the previous backup
    assert not backup.exists()
    reference, reference_losses = plain_fit([])
    assert losses == pytest.approx(reference_losses[2:], abs=TOLERANCE)
    for ours, theirs in zip(resumed.weights, reference.weights):
        assert max_difference(ours.numpy(), theirs.numpy()) <= TOLERANCE


def test_plain_keras_checkpoint_path_that_is_a_directory(tmp_path):
    (tmp_path / "model.keras").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        plain_fit([tp_callbacks.ModelCheckpoint(str(tmp_path / "model.keras"))], epochs=1)
    plain_fit([tp_callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="loss",
                                            save_best_only=True, verbose=1)], epochs=2)
    assert sorted(os.listdir(tmp_path)) == ["best.keras", "model.keras"]


def test_plain_keras_resumes_mid_epoch_exactly(tmp_path, capsys):
    # Backups every 3 batches (4 per epoch); interrupted before epoch 2's 4th batch, so the
    # last backup is after 2 batches of epoch 2: the resumed run skips those 2, with the
    # dropout generator's state and the epoch's metric state restored.
    backup = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        plain_fit([tp_callbacks.BackupAndRestore(backup, save_freq=3), InterruptAt(1, 3)],
                  epochs=3, dropout=True)
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        metadata = json.load(f)
    assert (metadata["epoch"], metadata["steps_done"]) == (1, 2)
    # Interrupted again, in the resumed run: its backups name the right epoch.
    with pytest.raises(Interrupted):
        plain_fit([tp_callbacks.BackupAndRestore(backup, save_freq=3), InterruptAt(2, 1)],
                  epochs=3, dropout=True)
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        metadata = json.load(f)
    assert (metadata["epoch"], metadata["steps_done"]) == (2, 1)
    resumed, losses = plain_fit([tp_callbacks.BackupAndRestore(backup, save_freq=3)],
                                epochs=3, dropout=True)
    printed = capsys.readouterr().out
    assert "resuming at epoch 2, after 2 of its steps" in printed
    assert "resuming at epoch 3, after 1 of its steps" in printed
    reference, reference_losses = plain_fit([], epochs=3, dropout=True)
    assert len(losses) == 1
    assert max_difference(losses, reference_losses[2:]) <= TOLERANCE
    for ours, theirs in zip(resumed.weights + resumed.optimizer.variables,
                            reference.weights + reference.optimizer.variables):
        assert max_difference(ours.numpy(), theirs.numpy()) <= TOLERANCE
