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
  weights file and the epoch, so the pair can never be torn; every rank restores from the
  files that JSON names (a shared filesystem, or a copy of rank 0's directory, on each host).

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
from keras.src.utils import io_utils

from tf_poseidon.export import atomic_path, consistent_state, run_on_chief

_BACKUP_WEIGHTS = re.compile(r"backup-\d+\.weights\.h5")


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
    """``keras.callbacks.BackupAndRestore`` (same arguments) for multi-process jobs.

    Layout of ``backup_dir`` (rank 0 writes it; it must belong to one training run):
    ``backup-<n>.weights.h5`` (model and optimizer variables) and ``training_metadata.json``
    (``{"epoch", "batch", "weights", "serial", "previous"}``), the commit point: a backup
    exists once the JSON naming it has been atomically replaced. ``double_checkpoint=True``
    keeps the previous weights file too, named under ``"previous"``, and falls back to it if
    the current one cannot be read.

    * ``on_train_begin`` — every rank reads the committed backup, if any, and restores the
      model, the optimizer and the epoch to start from. Not collective; every rank must see
      rank 0's files (shared filesystem or a copy).
    * each save — collective and blocking, as in :class:`ModelCheckpoint`.
    * ``on_train_end`` with ``delete_checkpoint=True`` — rank 0 removes ``backup_dir``;
      collective, so no rank starts another ``fit`` that could still see it.

    As with Keras, a backup taken mid-epoch (``save_freq`` an int) restarts that epoch from
    its beginning with the weights of the backup; resume is exact with ``save_freq="epoch"``.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._committed: dict | None = None

    def _weights_file(self, entry: dict) -> str:
        return os.path.join(self.backup_dir, entry["weights"])

    def on_train_begin(self, logs=None):
        self._committed = None
        if not os.path.exists(self._training_metadata_path):
            return
        with open(self._training_metadata_path) as f:
            self._committed = json.load(f)
        try:
            self._restore(self._committed)
        except OSError:
            previous = self._committed.get("previous")
            if previous is None:
                raise
            self._restore(previous)
            # The next backup's "previous" is the one just restored, not the unreadable one.
            self._committed = {**previous, "serial": self._committed["serial"],
                               "previous": None}

    def _restore(self, entry: dict) -> None:
        """Loads the backup ``entry`` names into the model and optimizer; sets the epoch."""
        if not self.model.built:
            raise ValueError("To use the BackupAndRestore callback, the model must be built "
                             "before fit() (call it on a batch, or build it).")
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self.model.load_weights(self._weights_file(entry))
        self.model._initial_epoch = entry["epoch"]

    def _save_model(self):
        with consistent_state(self.model):
            run_on_chief(self.model, self._write_backup, "write a backup")

    def _write_backup(self) -> int:
        """Rank 0: writes the weights file, then commits it by replacing the JSON."""
        os.makedirs(self.backup_dir, exist_ok=True)
        serial = (self._committed or {}).get("serial", 0) + 1
        entry = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                 "weights": f"backup-{serial}.weights.h5"}
        with atomic_path(self._weights_file(entry)) as temp:
            self.model.save_weights(temp, overwrite=True)
        previous = None
        if self.double_checkpoint and self._committed is not None:
            previous = {key: self._committed[key] for key in ("epoch", "batch", "weights")}
        committed = {**entry, "serial": serial, "previous": previous}
        with atomic_path(self._training_metadata_path) as temp:
            with open(temp, "w") as f:
                json.dump(committed, f)
        self._committed = committed
        keep = {entry["weights"]} | ({previous["weights"]} if previous else set())
        for name in os.listdir(self.backup_dir):
            if _BACKUP_WEIGHTS.fullmatch(name) and name not in keep:
                os.remove(os.path.join(self.backup_dir, name))
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
