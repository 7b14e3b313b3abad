"""tp.callbacks: rank 0 writes, atomically; a backup resumes exactly, at any number of ranks.

Real jobs (tests/workers/checkpoint_train.py, checkpoint_kill.py). One P=2 job trains the
reference run (4 epochs with ModelCheckpoints and a BackupAndRestore), then a second run that
every rank SIGKILLs after epoch 2; copies of its backup are resumed at P=1 (no launcher) and
P=3, and must end with the reference's weights and optimizer state. Checkpoint files are
loaded here, in a process that did not write them.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from multirank import WORKERS, check, job_env, run_job
from tf_poseidon import callbacks as tp_callbacks

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


def test_only_rank0_writes_checkpoints(interrupted):
    rank0, rank1 = interrupted / "rank0", interrupted / "rank1"
    assert sorted(os.listdir(rank0 / "ckpt")) == [f"epoch{e}.weights.h5"
                                                  for e in range(1, EPOCHS + 1)]
    assert (rank0 / "best.keras").is_file()
    assert not (rank0 / "backup").exists(), "BackupAndRestore deletes its backup after fit"
    assert os.listdir(rank1) == [], "rank 1 wrote files"
    assert not [n for n in os.listdir(rank0) if n.startswith(".tp-tmp-")]


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


def test_backup_is_committed_before_any_rank_goes_on(interrupted):
    backup = interrupted / "backup"
    with open(backup / "training_metadata.json") as f:
        metadata = json.load(f)
    assert metadata["epoch"] == INTERRUPT_AFTER
    # Only the committed weights file is left (earlier ones are removed after each commit).
    assert sorted(os.listdir(backup)) == sorted([metadata["weights"], "training_metadata.json"])


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


def wait_for(condition, process, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the worker ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    process = subprocess.Popen([sys.executable, os.path.join(WORKERS, "checkpoint_kill.py"),
                                str(tmp_path)], env=job_env(), stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: (tmp_path / "epoch1.json").exists(), process, 240,
                 "the first epoch's checkpoints")
        temp = tmp_path / f".tp-tmp-{process.pid}-model.keras"
        wait_for(temp.exists, process, 120, "the second epoch's save to start")
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert temp.exists() and not (tmp_path / "epoch2.json").exists(), "killed too late"
    with open(tmp_path / "epoch1.json") as f:
        epoch1 = json.load(f)
    model = keras.models.load_model(tmp_path / "model.keras")
    sums = [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights]
    assert sums == pytest.approx(epoch1, rel=1e-12)
    # The backup (written after the checkpoint) still names epoch 1 and loads.
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        metadata = json.load(f)
    assert metadata["epoch"] == 1
    model.load_weights(tmp_path / "backup" / metadata["weights"])
    assert [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights] == \
        pytest.approx(epoch1, rel=1e-12)


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


def plain_fit(callbacks, epochs=5) -> tuple[keras.Model, list]:
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
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
    assert sorted(os.listdir(backup)) == sorted([metadata["weights"],
                                                 metadata["previous"]["weights"],
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
