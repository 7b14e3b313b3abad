"""Before the first step: every rank checks it has the same variables, then takes rank 0's values.

Ranks build their models independently (possibly with different seeds), so the initial values
differ; rank 0's are broadcast once, in one message per dtype. A rank whose model differs
(variable count, shape or dtype) would otherwise hang or corrupt the first all-reduce; the
descriptions are compared first and every rank raises the same error naming the first mismatch.

This is the ranks' first meeting, so its wait is the start timeout (timeouts.start_s): the
fastest rank waits for the slowest to start, build its model and load its data. The op library
is loaded (or, on first use on this host, built) just before, so that a rank building it is
covered by that timeout rather than the step timeout of the first training step. The broadcast
then has a limit that grows with its bytes (timeouts.broadcast_s).

A restarted job (``tfposeidon-run --max-restarts``) must never start from scratch silently: at
this first broadcast, rank 0 says so unless ``tp.callbacks.BackupAndRestore`` has already
reported where training resumes (:func:`restart_reported`).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon import ops, timeouts
from tf_poseidon.comm import collectives
from tf_poseidon.comm.engine import CommEngine
from tf_poseidon.launcher import RESTART_ENV

Description = tuple[str, tuple, str]
FIRST_MEETING = "the ranks' first meeting (the check that they built the same variables)"
"""The label of the ranks' first meeting (the engine call that gathers their descriptions)."""

_restart_reported = False


def restart_reported() -> None:
    """Says that this process has reported where a restarted job's training resumes
    (``tp.callbacks.BackupAndRestore`` does, at the start of ``fit``), so that the first
    broadcast does not say that it starts from the beginning. Any rank, any thread; never
    blocks."""
    global _restart_reported
    _restart_reported = True


def _report_restart(rank: int) -> None:
    """On rank 0 of a restarted job, once: that training starts from the beginning, unless a
    BackupAndRestore has reported otherwise (module docstring)."""
    restart = os.environ.get(RESTART_ENV, "0")
    if restart == "0" or _restart_reported:
        return
    restart_reported()
    if rank == 0:
        print(f"tf_poseidon: restart {restart} of the job ({RESTART_ENV}={restart}), and no "
              "tp.callbacks.BackupAndRestore restored a backup: training starts from the "
              "beginning, from the weights this program built or loaded itself. Pass "
              "tp.callbacks.BackupAndRestore(backup_dir) to fit to resume where the job "
              "failed.", file=sys.stderr, flush=True)


def describe(variables: Sequence[tf.Variable]) -> list[Description]:
    """(name, shape, dtype) of each variable, picklable."""
    return [(v.name, tuple(v.shape.as_list()), v.dtype.name) for v in variables]


def first_mismatch(per_rank: Sequence[Sequence[Description]]) -> str | None:
    """A message naming the first difference between rank 0's descriptions and another's."""
    reference = per_rank[0]
    for rank, described in enumerate(per_rank[1:], start=1):
        for position, (mine, theirs) in enumerate(zip(reference, described)):
            if mine[1:] != theirs[1:]:
                return (f"variable {position} differs between rank 0 ({mine[0]}: shape "
                        f"{mine[1]}, {mine[2]}) and rank {rank} ({theirs[0]}: shape {theirs[1]}, "
                        f"{theirs[2]})")
        if len(described) != len(reference):
            shorter, longer = sorted([(len(reference), 0), (len(described), rank)])
            extra = (reference if longer[1] == 0 else described)[shorter[0]]
            return (f"rank 0 has {len(reference)} variables and rank {rank} has "
                    f"{len(described)}; the first one only rank {longer[1]} has is {extra[0]} "
                    f"(shape {extra[1]}, {extra[2]})")
    return None


def check_and_broadcast(engine: CommEngine, variables: Sequence[tf.Variable]) -> None:
    """Collective, eager, blocking: verifies ``variables`` match across ranks, then assigns
    rank 0's values to every rank's variables.

    Raises ValueError (on every rank) if the variables differ. Timeouts: the start timeout
    for the check, then the broadcast's (grows with the bytes); see timeouts.py. On a
    restarted job, rank 0 may print that training starts from the beginning (module
    docstring).
    """
    ops.available()  # loads, or builds, the op library before the meeting; see module doc
    described = describe(variables)
    per_rank = timeouts.engine_call(
        engine, lambda comm: comm.allgather(described), timeouts.start_s(), FIRST_MEETING,
        "TF_POSEIDON_START_TIMEOUT")
    mismatch = first_mismatch(per_rank)
    if mismatch:
        raise ValueError(
            "tf_poseidon: the ranks built different models: " + mismatch + ". Every rank must "
            "create the same variables in the same order under strategy.scope().")
    _report_restart(engine.rank)
    by_dtype: dict[tf.DType, list[tf.Variable]] = {}
    for v in variables:
        by_dtype.setdefault(v.dtype, []).append(v)
    for dtype, group in by_dtype.items():
        buffer = np.concatenate([np.asarray(v.numpy()).ravel() for v in group]) \
            if group else np.empty(0, dtype.as_numpy_dtype)
        timeouts.engine_call(
            engine, lambda comm, b=buffer: comm.Bcast(collectives.as_mpi_buffer(b), root=0),
            timeouts.broadcast_s(buffer.nbytes),
            f"the initial broadcast of {buffer.nbytes / 1e6:.1f} MB of {dtype.name} values",
            "TF_POSEIDON_TIMEOUT + 1 s per 10 MB")
        offset = 0
        for v in group:
            n = v.shape.num_elements()
            v.assign(buffer[offset:offset + n].reshape(v.shape.as_list()))
            offset += n
