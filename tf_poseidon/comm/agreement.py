"""Collective agreement: before a collective is posted, the ranks check they all post the same.

MPI matches collectives by order alone: if one rank posts the gradients of step 12 while another
posts an ``evaluate`` metric, MPI sums unrelated buffers of equal size, or hangs until the
timeout. So the engine (engine.py) runs :func:`agree` before every group instance and every
control-plane call: each rank contributes a 16-byte digest of its :class:`Signature` (what it is
about to post: the group's name, its buckets' kinds, planned bytes and dtypes) to one
non-blocking all-gather; if the digests differ, every rank sees it at once, the ranks exchange
their descriptions, each rank prints the mismatch (so that every rank's output has it before
any rank aborts the job), and every rank raises :class:`CollectiveMismatchError` naming both
sides. The instance (the step) is reported, not compared: a function retraced on one rank only
starts counting again there.

Engine thread only. The wait is bounded by the collective timeout (or the caller's
``give_up``): a peer that never posts anything (dead, hung, or waiting elsewhere) raises
CollectiveTimeoutError instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
import time
from typing import Callable, Collection, Sequence

import numpy as np

from tf_poseidon.comm.errors import CollectiveMismatchError, CollectiveTimeoutError

END_OF_PROGRAM = "end of program"
"""The control-plane call every rank makes at exit (engine.py)."""
EPOCH_END_MEETING = "the meeting of all ranks at the end of an epoch"
"""The control-plane call of ranks that step at their own pace at an epoch's end
(timeouts.meet)."""
RANK0_WRITE = "work of rank 0 that the other ranks wait for (a save, a checkpoint, an export)"
"""The control-plane call that starts every write rank 0 makes for all ranks (chief.run)."""
STEP_GROUPS = ("micro_batch", EPOCH_END_MEETING)
"""What training posts under every algorithm, besides the algorithm's own groups
(``Algorithm.training_groups``, which the strategy declares to the engine): the Keras
integration's count of a step's examples when gradients are accumulated, and the meeting at an
epoch's end that only a rank that trained the epoch reaches."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a rank is about to post: ``what`` (a group's name, or a control-plane call's
    label), ``instance`` (which execution of the group: the step, for gradients; None for
    calls), ``layout`` (per bucket: kind, planned payload bytes, dtype name) and ``call``
    (a control-plane call rather than a group of buckets)."""

    what: str
    instance: int | None
    layout: tuple[tuple[str, int, str], ...] = ()
    call: bool = False

    def digest(self) -> np.ndarray:
        """Two int64 words identifying ``what``, ``layout`` and ``call`` (a new array)."""
        return _digest(self.what, self.layout, self.call).copy()

    def describe(self) -> str:
        """E.g. ``gradients step 12 (2 buckets: allreduce 4.0 MiB float32, sfb 20.5 kB
        float32)``, ``control-plane call 'input data'``."""
        if self.call:
            head = f"control-plane call {self.what!r}"
        elif self.instance is None:
            head = self.what
        else:
            head = (f"{self.what} {'step' if self.what == 'gradients' else 'instance'} "
                    f"{self.instance}")
        if not self.layout:
            return head
        buckets = ", ".join(f"{kind} {_size(nbytes)} {dtype}"
                            for kind, nbytes, dtype in self.layout)
        plural = "s" if len(self.layout) != 1 else ""
        return f"{head} ({len(self.layout)} bucket{plural}: {buckets})"


def agree(comm, signature: Signature, timeout_s: float, training: Collection[str] = (),
          give_up: Callable[[], str | None] | None = None) -> None:
    """Collective, engine thread, blocking: returns when every rank posts a signature equal to
    ``signature`` (up to the instance).

    Otherwise every rank prints ``[tf_poseidon rank R] CollectiveMismatchError: ...`` to its
    stderr, waits until every rank has (at most ``timeout_s``), and raises
    CollectiveMismatchError with the same message (:func:`mismatch_message`; ``training``:
    the names of the groups and calls that training steps post, for its hint). Raises
    CollectiveTimeoutError if some rank does not post its signature: after ``timeout_s``, or
    as soon as ``give_up()`` (called while waiting) returns a message, which becomes the
    error's.
    """
    size = comm.Get_size()
    mine = signature.digest()
    everyone = np.empty((size, mine.size), np.int64)
    if give_up is None:
        give_up = _deadline(timeout_s, lambda: (
            f"tf_poseidon: this rank posted {signature.describe()} and waited {timeout_s:.0f} s "
            "for the other ranks to post theirs: a peer rank has died, hangs, or runs a "
            "different program. Set TF_POSEIDON_TIMEOUT to wait longer."))
    _wait(comm.Iallgather(mine, everyone), give_up)
    if (everyone == everyone[0]).all():
        return
    # Every rank saw the same digests, so every rank is here: the two exchanges below complete.
    sides = comm.allgather((signature.what, signature.describe()))
    message = mismatch_message(sides, training)
    sys.stderr.write(f"[tf_poseidon rank {comm.Get_rank()}] CollectiveMismatchError: "
                     f"{message.removeprefix('tf_poseidon: ')}\n")
    sys.stderr.flush()
    _wait(comm.Ibarrier(), _deadline(timeout_s, lambda: (
        f"tf_poseidon: the ranks found that they posted different collectives, and some did "
        f"not report it within {timeout_s:.0f} s: {message}")))
    raise CollectiveMismatchError(message)


def mismatch_message(sides: Sequence[tuple[str, str]], training: Collection[str] = ()) -> str:
    """The message every rank raises. ``sides``: per rank, what it posted (its signature's
    ``what``) and its description. The message lists each distinct description with the ranks
    that posted it, then what usually causes such a mismatch: a rank that reached the end of
    its program or wrote for all ranks (:data:`RANK0_WRITE`) alone, or one that was still
    training (posted one of ``training`` or :data:`STEP_GROUPS`) while another had moved on,
    or else a collective run on some ranks only."""
    by_description: dict[str, list[int]] = {}
    for rank, (_, description) in enumerate(sides):
        by_description.setdefault(description, []).append(rank)
    listed = "; ".join(f"{rank_list(ranks)} posted {description}"
                       for description, ranks in by_description.items())
    message = (f"tf_poseidon: the ranks posted different collectives: {listed}. Every rank "
               "must run the same collectives in the same order.")
    posted = {what for what, _ in sides}
    if RANK0_WRITE in posted:
        message += (" Some ranks were saving and others were not: a save (model.save, "
                    "save_weights or export, tf.train.Checkpoint or CheckpointManager.save, "
                    "tf.saved_model.save) ran on some ranks only (e.g. under `if "
                    "tp.is_chief():`), or a callback that saves (tp.callbacks.ModelCheckpoint, "
                    "BackupAndRestore) was given to fit on some ranks only: call saves on every "
                    "rank and give fit the same callbacks on every rank (rank 0 writes, and "
                    "every rank returns once the write is complete).")
    elif END_OF_PROGRAM in posted:
        message += (" A rank reached the end of its program while another still communicated: "
                    "code that runs fit/evaluate/predict or a strategy.reduce on some ranks "
                    "only (e.g. under `if tp.is_chief():`) must run on every rank.")
    elif posted & {*training, *STEP_GROUPS}:
        message += (" One rank was still training while another had moved on: the ranks ran "
                    "different numbers of steps (different data on each rank: pass the same "
                    "global data to every rank, or use "
                    "strategy.distribute_datasets_from_function), or a callback or "
                    "TerminateOnNaN stopped training on some ranks only: fit's callbacks "
                    "must be the same on every rank.")
    else:
        message += (" Look for a collective (evaluate, predict, strategy.reduce/gather, a "
                    "callback that reduces) that runs on some ranks only.")
    return message


def _deadline(timeout_s: float, message: Callable[[], str]) -> Callable[[], str | None]:
    """A ``give_up`` for :func:`_wait`: ``message()`` once ``timeout_s`` have passed."""
    end = time.perf_counter() + timeout_s
    return lambda: message() if time.perf_counter() > end else None


def _wait(request, give_up: Callable[[], str | None]) -> None:
    """Polls ``request`` until it completes, or raises CollectiveTimeoutError with the message
    ``give_up()`` returns. Spins briefly (the common case: the peers are there), then sleeps
    between polls so that a long wait does not take a core from the computation."""
    start = time.perf_counter()
    sleep = 0.0
    while not request.Test():
        reason = give_up()
        if reason:
            raise CollectiveTimeoutError(reason)
        if time.perf_counter() - start > 1e-3:
            sleep = min(max(2 * sleep, 2e-5), 5e-4)
            time.sleep(sleep)


@functools.lru_cache(maxsize=1024)
def _digest(what: str, layout: tuple, call: bool) -> np.ndarray:
    text = repr((what, layout, call)).encode()
    return np.frombuffer(hashlib.blake2b(text, digest_size=16).digest(), np.int64)


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
