"""Writing a model out of a job: rank 0 writes, atomically, from a consistent state.

Everything that writes model state to disk (``export_for_serving`` here, the callbacks in
callbacks.py, Keras' ``Model.save``, ``save_weights`` and ``export`` under a multi-process
strategy through :func:`save_on_chief`) follows one protocol, made of the three pieces of this
module:

* :func:`consistent_state` — every rank enters ``strategy.extended.consistent_state()``, so the
  model's variables hold the state to save (SSP drains, EASGD swaps the center in);
* :func:`run_on_chief` — rank 0 alone does the writing while the other ranks wait for its
  outcome (its result, or its failure), for as long as rank 0 sends heartbeats (chief.py):
  when it returns on any rank, the file is committed;
* :func:`atomic_path` — the writer writes into a temporary name in the target's own directory,
  fsyncs it, and renames it into place (``os.replace`` for a file, ``os.rename`` for a
  directory), so a crash at any moment leaves either the previous file or the new one.

A model not created under a multi-process :class:`~tf_poseidon.PoseidonStrategy` (plain Keras,
or a world of one) gets the same behaviour without any collective.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from typing import Callable, ContextManager, Iterator

import keras
import tensorflow as tf

from tf_poseidon import chief, stateful_rnn

_TEMP_PREFIX = ".tp-tmp-"
SERVING_SIGNATURE = "serving_default"


# -- the protocol ---------------------------------------------------------------------------

def multi_rank_strategy(model: keras.Model):
    """The PoseidonStrategy ``model`` was created under if it spans several ranks, else None."""
    from tf_poseidon.strategy import PoseidonStrategy
    strategy = model.distribute_strategy
    if isinstance(strategy, PoseidonStrategy) and strategy.num_replicas_in_sync > 1:
        return strategy
    return None


def consistent_state(model: keras.Model) -> ContextManager[None]:
    """Within it, ``model``'s variables hold the state to save, equal on every rank, and its
    stateful RNNs the states of the whole batch (stateful_rnn.py), as one process's model.

    Collective when ``model`` was created under a PoseidonStrategy: call it on every rank,
    at the same point of the program. Otherwise it does nothing.
    """
    strategy = multi_rank_strategy(model)
    if strategy is None:
        return contextlib.nullcontext()
    return _consistent_whole_model(model, strategy.extended)


@contextlib.contextmanager
def _consistent_whole_model(model: keras.Model, extended) -> Iterator[None]:
    with extended.consistent_state(), stateful_rnn.whole_batch_states(model, extended):
        yield


class _ChiefWrites(threading.local):
    """Whether this thread runs rank 0's work for :func:`run_on_chief`: a ``model.save``
    there (tp.callbacks' writes) writes as it is, instead of starting a collective of its own
    (:func:`save_on_chief`)."""

    active = False


_chief_writes = _ChiefWrites()


def run_on_chief(model: keras.Model, work: Callable[[], int], what: str) -> int:
    """Runs ``work()`` on rank 0 only; returns its result (an int ≥ 0) on every rank.

    Collective and blocking when ``model`` was created under a multi-process PoseidonStrategy:
    every rank calls it; rank 0 runs ``work`` and the others wait for its outcome as long as
    rank 0's heartbeats keep coming (at most ``TF_POSEIDON_CHIEF_TIMEOUT``; chief.py), so no
    rank returns before rank 0 finished. If ``work`` raises on rank 0, rank 0 re-raises it and
    every other rank raises RuntimeError naming ``what`` (rank 0's output holds the reason).
    Without such a strategy ``work`` simply runs here.
    """
    def flagged() -> int:
        outer, _chief_writes.active = _chief_writes.active, True
        try:
            return work()
        finally:
            _chief_writes.active = outer

    strategy = multi_rank_strategy(model)
    if strategy is None:
        return flagged()
    return chief.run(strategy.extended.engine, flagged, what)


def save_on_chief(model: keras.Model, save: Callable[[str], object], filepath: str,
                  what: str, atomic: bool = True) -> None:
    """``save(path)`` (Keras' ``model.save``, ``save_weights``, ...) writing ``filepath``, on
    rank 0 only, from the consistent state: collective and blocking under a multi-process
    PoseidonStrategy (:func:`consistent_state`, :func:`run_on_chief`: every rank returns once
    the file is in place). ``atomic``: ``path`` is a temporary beside ``filepath``
    (:func:`atomic_path`); else ``filepath`` itself (a write of several files or of a
    directory). Within rank 0's work of :func:`run_on_chief` (a write under way) it just writes.
    """
    def write() -> int:
        if not atomic:
            save(filepath)
            return 0
        with atomic_path(filepath) as temp:
            save(temp)
        return 0

    if _chief_writes.active:
        save(filepath)
        return
    with consistent_state(model):
        run_on_chief(model, write, what)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """fsyncs ``path`` (a file, or a directory with everything in it)."""
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
    else:
        _fsync(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path next to ``path``; on normal exit it becomes ``path`` atomically.

    Write a file or a directory at the yielded path (its name ends with ``path``'s own name, so
    writers that pick the format from the extension still do). On exit, everything written is
    fsynced and renamed to ``path``: a file replaces an existing ``path``; a directory may
    only be created (IsADirectoryError if ``path`` exists). Then the directory entry is fsynced
    and leftovers of earlier writes to ``path`` killed mid-way are removed (the target must
    have a single writer). If the body raises, the temporary is removed and ``path`` is
    untouched. Not collective: the writing rank alone uses it.
    """
    directory, name = os.path.split(os.path.abspath(path))
    temp = os.path.join(directory, f"{_TEMP_PREFIX}{os.getpid()}-{name}")
    _remove(temp)
    try:
        yield temp
        if not os.path.exists(temp):
            raise FileNotFoundError(f"nothing was written at {temp} for {path}")
        _fsync_tree(temp)
        if os.path.isdir(temp):
            if os.path.lexists(path):
                raise IsADirectoryError(f"{path} already exists; an export never replaces one.")
            os.rename(temp, path)
        else:
            os.replace(temp, path)
        _fsync(directory)
    finally:
        _remove(temp)
    leftover = re.compile(rf"{re.escape(_TEMP_PREFIX)}\d+-{re.escape(name)}")
    for entry in os.listdir(directory):
        if leftover.fullmatch(entry):
            _remove(os.path.join(directory, entry))


# -- export for TensorFlow Serving ----------------------------------------------------------

def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        count = seen.get(name, 0)
        seen[name] = count + 1
        unique.append(name if not count else f"{name}_{count}")
    return unique


def _input_specs(model: keras.Model) -> tuple[list, list[tf.TensorSpec]]:
    """(Keras' positional call structure for ``model``, one named TensorSpec per input).

    Inputs are named after their ``keras.Input`` layers, with the batch dimension None.
    """
    from keras.src.export.export_utils import get_input_signature
    structure = get_input_signature(model)
    flat = tf.nest.flatten(structure)
    names = _unique([tensor._keras_history.operation.name for tensor in model.inputs])
    specs = [tf.TensorSpec((None, *spec.shape[1:]), spec.dtype, name=name)
             for spec, name in zip(flat, names)]
    return structure, specs


def _named_outputs(model: keras.Model, outputs) -> dict[str, tf.Tensor]:
    """``model``'s outputs by name: a dict's keys, else the names of the layers producing them."""
    if isinstance(outputs, dict):
        return dict(outputs)
    names = _unique([tensor._keras_history.operation.name for tensor in model.outputs])
    return dict(zip(names, tf.nest.flatten(outputs)))


def _check_exportable(model: keras.Model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"export_for_serving takes a keras.Model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError("export_for_serving: the model is not built; build it (or train it) "
                         "first.")
    if not getattr(model, "inputs", None):  # subclassed models have none
        raise ValueError(
            "export_for_serving needs a Functional or Sequential model (built from keras.Input) "
            "so that its inputs have names and shapes; for a subclassed model export "
            "keras.Model(inputs, model(inputs)) built from keras.Input layers.")


def _next_version(export_dir: str) -> int:
    versions = [int(name) for name in os.listdir(export_dir) if name.isdigit()]
    return max(versions, default=0) + 1


def _write_saved_model(model: keras.Model, path: str) -> None:
    structure, specs = _input_specs(model)

    def serve(*tensors: tf.Tensor) -> dict[str, tf.Tensor]:
        inputs = tf.nest.pack_sequence_as(structure, list(tensors))
        return _named_outputs(model, model(*inputs, training=False))

    archive = keras.export.ExportArchive()
    archive.track(model)
    # The first endpoint is also written as the "serving_default" signature.
    archive.add_endpoint("serve", tf.function(serve, input_signature=specs))
    archive.write_out(path, verbose=False)


def export_for_serving(model: keras.Model, export_dir: str, version: int | None = None) -> str:
    """Exports ``model`` for TensorFlow Serving as ``export_dir/<version>/`` (a SavedModel).

    The SavedModel has the ``serving_default`` signature (also callable as ``serve``): one
    input per ``keras.Input``, named after it, and one output per model output, named by the
    output dict's keys or else by the layers producing them; every batch dimension is None.
    Its graph holds stock TensorFlow ops only (no py_function, no tf_poseidon op), so a plain
    ``tensorflow_model_server`` loads it. The model runs with ``training=False``.

    Call it on every rank (collective and blocking under a multi-process PoseidonStrategy:
    it enters ``consistent_state`` and returns once rank 0 has written; see the module
    docstring). Rank 0 alone writes, atomically: into a temporary directory beside the version
    directory, renamed into place when complete (TF Serving ignores names that are not
    numbers). A model created without PoseidonStrategy is exported by this process alone.

    Args:
      model: a built Functional or Sequential keras.Model.
      export_dir: the model's base path for TF Serving (``--model_base_path``); created if
        missing. Relative paths are relative to rank 0's working directory.
      version: a positive int, or None for one more than the largest numeric subdirectory
        of ``export_dir`` (1 for the first export).

    Returns:
      The version directory's path (on rank 0's filesystem), the same on every rank.

    Raises:
      TypeError, ValueError: ``model`` or ``version`` is not acceptable (raised on every rank).
      NotADirectoryError: ``export_dir`` exists and is not a directory (on rank 0).
      FileExistsError: ``export_dir/<version>`` exists already; versions are never overwritten
        (on rank 0).
      RuntimeError: on ranks other than 0, when rank 0 raised one of the above.
    """
    _check_exportable(model)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version < 1):
        raise ValueError(f"version must be a positive int or None, got {version!r}.")
    export_dir = os.fspath(export_dir)

    def write() -> int:
        if os.path.exists(export_dir) and not os.path.isdir(export_dir):
            raise NotADirectoryError(f"export_dir {export_dir!r} exists and is not a "
                                     "directory.")
        os.makedirs(export_dir, exist_ok=True)
        chosen = _next_version(export_dir) if version is None else version
        target = os.path.join(export_dir, str(chosen))
        if os.path.lexists(target):
            raise FileExistsError(f"{target} already exists; pick another version (or None "
                                  "for the next one).")
        with atomic_path(target) as temp:
            _write_saved_model(model, temp)
        return chosen

    with consistent_state(model):
        chosen = run_on_chief(model, write, f"export the model to {export_dir}")
    return os.path.join(export_dir, str(chosen))
