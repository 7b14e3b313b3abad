"""Keras' ModelCheckpoint and BackupAndRestore for multi-process jobs: rank 0 writes, atomically.

Keras 3.15's own callbacks know nothing of ranks: under any strategy but TensorFlow's
MultiWorkerMirroredStrategy every process writes the same path (concurrent writers of one HDF5
or zip file on a shared filesystem), each write truncates the previous file before the new one
is complete (a crash mid-write loses both), BackupAndRestore's weights and epoch are two files
written one after the other, and every rank deletes the backup at the end of training. These
subclasses take the same arguments and change only where and how files are written
(docs/checkpoints.md):

* every rank enters ``consistent_state`` at the same points (each save, by the same
  ``save_freq`` counting on every rank); rank 0 alone decides and writes; every rank returns
  once the file is committed (export.run_on_chief);
* files are written under a temporary name in the same directory, fsynced, then renamed into
  place (export.atomic_path);
* BackupAndRestore commits a backup by atomically replacing one small JSON file that names the
  weights file, the state file (random generators, the epoch's metrics) and the epoch and step,
  so they can never be torn apart; every rank restores from the files that JSON names (a
  shared filesystem, or a copy of rank 0's directory, on each host), and a backup taken in the
  middle of an epoch resumes at the step after it (Keras restarts that epoch).

A backup holds the model's and the optimizer's variables, which are the same at any number of
ranks: a job may resume with a different world size (with the same global batch, sync training
then continues exactly as it would have).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import keras
import numpy as np
from keras.src.backend.common import global_state
from keras.src.random import seed_generator as keras_seed_generator
from keras.src.utils import io_utils

from tf_poseidon import initial_sync
from tf_poseidon.export import atomic_path, consistent_state, multi_rank_strategy, run_on_chief
from tf_poseidon.launcher import RESTART_ENV

_ALGORITHM = "algorithm/"  # prefix of the algorithm's state in a backup's state file
_BACKUP_FILE = re.compile(r"backup-\d+\.(weights\.h5|state\.npz)")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` (same arguments) that writes on rank 0, atomically.

    Every rank must use it with the same arguments. At each save point (every epoch, or every
    ``save_freq`` batches) every rank enters the strategy's ``consistent_state``; rank 0
    formats ``filepath``, applies ``save_best_only`` to the global metrics, and writes
    ``model.save`` / ``model.save_weights`` to a temporary file beside the target that is
    fsynced and renamed over it. Collective and blocking: each save returns on every rank once
    the file is in place. Relative paths are relative to rank 0's working directory.
    """

    def _save_model(self, epoch, batch, logs):
        def write() -> int:
            filepath = self._get_file_path(epoch, batch, logs)
            if not self._should_save_model(epoch, batch, logs, filepath):
                return 0
            if os.path.isdir(filepath):
                raise IsADirectoryError(f"ModelCheckpoint: {filepath} is a directory; give a "
                                        "file path.")
            directory = os.path.dirname(filepath)
            if directory:
                os.makedirs(directory, exist_ok=True)
            save = self.model.save_weights if self.save_weights_only else self.model.save
            with atomic_path(filepath) as temp:
                save(temp, overwrite=True)
            if self.verbose > 0:
                io_utils.print_msg(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")
            return 0

        with consistent_state(self.model):
            run_on_chief(self.model, write, "write a checkpoint")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` (same arguments) for multi-process jobs, resuming
    exactly where the backup was taken, also in the middle of an epoch.

    Layout of ``backup_dir`` (rank 0 writes it; it must belong to one training run):
    ``backup-<n>.weights.h5`` (model and optimizer variables), ``backup-<n>.state.npz`` (what
    else the next steps depend on: the random generators' states of the model's layers and
    Keras' global one, and the epoch's metric states summed over ranks) and
    ``training_metadata.json`` (``{"epoch", "batch", "steps_done", "weights", "state",
    "serial", "previous"}``), the commit point: a backup exists once the JSON naming it has
    been atomically replaced. The state file also holds the strategy's algorithm state
    (``algorithm/...``: low-rank compression's residuals, summed over ranks, and its Q), which
    is restored on every rank (each takes 1/P of the summed residuals) and never exported. ``double_checkpoint=True`` keeps the previous backup's files too,
    named under ``"previous"``, and falls back to them if the current weights cannot be read.

    * ``on_train_begin`` — every rank reads the committed backup, if any, and restores the
      model, the optimizer, the random generators and the epoch to start from; rank 0 prints
      where training resumes (on a restarted job without a backup: that it starts from the
      beginning). Not collective; every rank must see rank 0's files (shared filesystem or a
      copy).
    * a backup taken after ``steps_done`` steps of an epoch (``save_freq`` an int) resumes in
      that epoch: its first ``steps_done`` batches are read from the input and skipped (their
      batch callbacks see empty logs, and no backup is taken during them), the epoch's metric
      states are restored, and training goes on with the next batch. With the same global
      batch, the same input order (``shuffle=False``, or an input whose order per epoch does
      not depend on the epochs run before) and the same number of ranks, the resumed run
      ends with the weights of an uninterrupted one.
    * each save — collective and blocking, as in :class:`ModelCheckpoint` (one more small
      collective sums the metric states).
    * ``on_train_end`` with ``delete_checkpoint=True`` — rank 0 removes ``backup_dir``;
      collective, so no rank starts another ``fit`` that could still see it.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._committed: dict | None = None
        self._in_epoch = False
        self._resume_steps = 0              # steps of the resumed epoch to skip
        self._resume_metrics: list | None = None
        self._skipped = 0                   # batches of this epoch that _skip_steps skips

    def _file(self, name: str) -> str:
        return os.path.join(self.backup_dir, name)

    # -- restoring ---------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._committed, self._resume_steps, self._resume_metrics = None, 0, None
        initial_sync.restart_reported()  # said below: where training resumes, or from scratch
        if not os.path.exists(self._training_metadata_path):
            restart = os.environ.get(RESTART_ENV, "0")
            if restart != "0" and _is_chief(self.model):
                io_utils.print_msg(f"tf_poseidon BackupAndRestore: restart {restart} of the job "
                                   f"but no backup in {self.backup_dir}: training starts from "
                                   "the beginning.")
            return
        with open(self._training_metadata_path) as f:
            self._committed = json.load(f)
        entry = self._committed
        try:
            self._restore(entry)
        except OSError:
            entry = self._committed.get("previous")
            if entry is None:
                raise
            self._restore(entry)
            # The next backup's "previous" is the one just restored, not the unreadable one.
            self._committed = {**entry, "serial": self._committed["serial"], "previous": None}
        if _is_chief(self.model):
            where = (f"after {entry.get('steps_done', 0)} of its steps"
                     if entry.get("steps_done") else "at its beginning")
            io_utils.print_msg(f"tf_poseidon BackupAndRestore: resuming at epoch "
                               f"{entry['epoch'] + 1}, {where}, from "
                               f"{self._file(entry['weights'])}")

    def _restore(self, entry: dict) -> None:
        """Loads the backup ``entry`` names into the model, the optimizer and the random
        generators; sets the epoch (and the steps of it) to resume at."""
        if not self.model.built:
            raise ValueError("To use the BackupAndRestore callback, the model must be built "
                             "before fit() (call it on a batch, or build it).")
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self.model.load_weights(self._file(entry["weights"]))
        if entry.get("state"):
            with np.load(self._file(entry["state"])) as state:
                arrays = dict(state)
            seeds = _seed_states(self.model, "seed_global" in arrays)
            if len(seeds) != sum(name.startswith("seed_") for name in arrays):
                raise ValueError(f"{self._file(entry['state'])} holds the random state of "
                                 "another model.")
            for name, variable in seeds.items():
                variable.assign(arrays[name])
            strategy = multi_rank_strategy(self.model)
            if strategy is not None:
                strategy.extended.algorithm_impl.restore_training_state(
                    {name[len(_ALGORITHM):]: value for name, value in arrays.items()
                     if name.startswith(_ALGORITHM)})
            self._resume_metrics = [arrays[f"metric_{i}"] for i in range(
                sum(name.startswith("metric_") for name in arrays))]
        self._resume_steps = int(entry.get("steps_done", 0))
        self.model._initial_epoch = entry["epoch"]

    def on_epoch_begin(self, epoch, logs=None):
        self._in_epoch = True
        self._current_epoch = epoch  # Keras sets it at epoch ends only: wrong after a resume
        if self._resume_steps:
            self._restore_metrics()
            self._skip_steps(self._resume_steps)
            self._resume_steps = 0

    def _restore_metrics(self) -> None:
        """The resumed epoch's metric states: 1/P of their sums over ranks on every rank (the
        strategy sums them over ranks for every result; and the same value on every rank
        survives the broadcast of rank 0's values before the first step)."""
        variables = self.model.metrics_variables
        values = self._resume_metrics or []
        if len(values) != len(variables):
            raise ValueError("the backup holds the metric states of another compile().")
        strategy = multi_rank_strategy(self.model)
        ranks = strategy.num_replicas_in_sync if strategy is not None else 1
        for variable, value in zip(variables, values):
            variable.assign(value / ranks if ranks > 1 else value)

    def _skip_steps(self, steps: int) -> None:
        """Makes the next calls of the model's train function read their batches from the
        input without training on them, ``steps`` batches in all; the last such call returns
        the epoch's metrics so far (the restored ones)."""
        model, original = self.model, self.model.train_function
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        remaining = self._skipped = steps

        def skip(iterator):
            nonlocal remaining
            count = min(per_call, remaining)
            for _ in range(count):
                next(iterator)
            remaining -= count
            if remaining:
                return {}
            model.train_function = original
            return model.get_metrics_result()

        model.train_function = skip

    # -- saving ------------------------------------------------------------------------------

    def on_epoch_end(self, epoch, logs=None):
        self._in_epoch, self._skipped = False, 0
        super().on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if batch < self._skipped:  # done before the backup: neither counted nor saved again
            self._last_batch_seen = batch
            return
        super().on_train_batch_end(batch, logs)

    def _save_model(self):
        with consistent_state(self.model):
            state = self._state_to_save()
            run_on_chief(self.model, lambda: self._write_backup(state), "write a backup")

    def _state_to_save(self) -> dict[str, np.ndarray]:
        """Every rank: the random generators' states, the metric states summed over ranks and
        the algorithm's own state (collectives under a multi-process strategy)."""
        state = {name: v.numpy() for name, v in _seed_states(self.model).items()}
        metrics = [v.value for v in self.model.metrics_variables]
        strategy = multi_rank_strategy(self.model)
        if strategy is not None:
            state.update({_ALGORITHM + name: value for name, value in
                          strategy.extended.algorithm_impl.training_state().items()})
        if strategy is not None and metrics:
            metrics = strategy.extended.sum_over_ranks(metrics, "backup_metrics")
        state.update({f"metric_{i}": keras.ops.convert_to_numpy(m)
                      for i, m in enumerate(metrics)})
        return state

    def _write_backup(self, state: dict[str, np.ndarray]) -> int:
        """Rank 0: writes the weights and state files, then commits them by replacing the
        JSON."""
        os.makedirs(self.backup_dir, exist_ok=True)
        serial = (self._committed or {}).get("serial", 0) + 1
        entry = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                 "steps_done": self._last_batch_seen + 1 if self._in_epoch else 0,
                 "weights": f"backup-{serial}.weights.h5", "state": f"backup-{serial}.state.npz"}
        with atomic_path(self._file(entry["weights"])) as temp:
            self.model.save_weights(temp, overwrite=True)
        with atomic_path(self._file(entry["state"])) as temp:
            with open(temp, "wb") as f:
                np.savez(f, **state)
        previous = None
        if self.double_checkpoint and self._committed is not None:
            previous = {key: value for key, value in self._committed.items()
                        if key not in ("serial", "previous")}
        committed = {**entry, "serial": serial, "previous": previous}
        with atomic_path(self._training_metadata_path) as temp:
            with open(temp, "w") as f:
                json.dump(committed, f)
        self._committed = committed
        keep = {entry["weights"], entry["state"]}
        if previous:
            keep |= {previous["weights"], previous.get("state")}
        for name in os.listdir(self.backup_dir):
            if _BACKUP_FILE.fullmatch(name) and name not in keep:
                os.remove(self._file(name))
        return 0

    def on_train_end(self, logs=None):
        if not self.delete_checkpoint:
            return

        def delete() -> int:
            if os.path.exists(self.backup_dir):
                shutil.rmtree(self.backup_dir)
            self._committed = None
            return 0

        run_on_chief(self.model, delete, f"delete {self.backup_dir}")


_WRITE_ON_EVERY_RANK = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)
_LOGS_OF_RANK_0 = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


def for_this_rank(callbacks, rank: int) -> list:
    """The callbacks a multi-rank ``fit`` runs on ``rank``, of the ``callbacks`` its caller
    passed (a list, or a ``keras.callbacks.CallbackList``, which is only checked; every rank
    alike).

    Raises ValueError for Keras' own ModelCheckpoint or BackupAndRestore (or a subclass not of
    this module): every rank would write the same files, truncating them before each write (the
    module docstring; docs/checkpoints.md). Keras' CSVLogger and TensorBoard run on rank 0
    only: they write what the logs say, and the logs are the same on every rank (the global
    metrics), so the other ranks would write the same rows into the same file, or event files
    of their own beside rank 0's. Every other callback runs on every rank."""
    given = list(getattr(callbacks, "callbacks", callbacks))
    for callback in given:
        if (isinstance(callback, _WRITE_ON_EVERY_RANK)
                and not isinstance(callback, (ModelCheckpoint, BackupAndRestore))):
            keras_name = next(c.__name__ for c in _WRITE_ON_EVERY_RANK
                              if isinstance(callback, c))
            named = (f"keras.callbacks.{keras_name}" if type(callback).__module__.startswith(
                "keras.") else f"{type(callback).__qualname__} (a keras.callbacks.{keras_name})")
            raise ValueError(
                f"tf_poseidon: {named} in a multi-rank fit: Keras' {keras_name} writes the "
                "same files from every rank "
                "(concurrent writers of one file: h5py's lock error, or interleaved writes "
                "without file locks) and truncates each before the new one is complete. Use "
                f"tp.callbacks.{keras_name}, which takes the same arguments: rank 0 writes, "
                "atomically (docs/checkpoints.md).")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks  # Keras' own container, which fit uses as it was built
    return [c for c in given if rank == 0 or not isinstance(c, _LOGS_OF_RANK_0)]


def _is_chief(model: keras.Model) -> bool:
    strategy = multi_rank_strategy(model)
    return strategy is None or strategy.extended.should_checkpoint


def _seed_states(model: keras.Model, with_global: bool = False) -> dict:
    """The state variables of the random generators ``model``'s next steps draw from, by
    name: its layers' (Dropout, noise, ...: ``seed_<i>``) and Keras' global one
    (``seed_global``) if it exists, or ``with_global`` (which creates it)."""
    weights = {id(v) for v in model.weights}
    states = {f"seed_{i}": v for i, v in
              enumerate(v for v in model.variables if id(v) not in weights)}
    if with_global or global_state.get_global_attribute("global_seed_generator") is not None:
        states["seed_global"] = keras_seed_generator.global_seed_generator().state
    return states
