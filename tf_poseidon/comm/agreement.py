"""Collective agreement: before a collective is posted, the ranks check they all post the same.

MPI matches collectives by order alone: if one rank posts the gradients of step 12 while another
posts an ``evaluate`` metric, MPI sums unrelated buffers of equal size, or hangs until the
timeout. So the engine (engine.py) runs :func:`agree` before every group instance and every
control-plane call: each rank contributes a 16-byte digest of its :class:`Signature` (what it is
about to post: the group's name, its buckets' kinds, planned bytes and dtypes) to one
non-blocking all-gather; if the digests differ, every rank sees it at once, the ranks exchange
their descriptions, and every rank raises :class:`CollectiveMismatchError` naming both sides.
The instance (the step) is reported, not compared: a function retraced on one rank only starts
counting again there.

Engine thread only. The wait is bounded by the collective timeout: a peer that never posts
anything (dead, hung, or waiting elsewhere) raises CollectiveTimeoutError instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time

import numpy as np

from tf_poseidon.comm.errors import CollectiveMismatchError, CollectiveTimeoutError

END_OF_PROGRAM = "end of program"
TRAINING_GROUPS = ("gradients", "ssp_deltas", "easgd", "micro_batch")
"""The groups that training steps post: one side still training means the ranks' steps
differ."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a rank is about to post: ``what`` (a group's name, or a control-plane call's),
    ``instance`` (which execution of the group: the step, for gradients; None for calls) and
    ``layout`` (per bucket: kind, planned payload bytes, dtype name)."""

    what: str
    instance: int | None
    layout: tuple[tuple[str, int, str], ...] = ()

    def digest(self) -> np.ndarray:
        """Two int64 words identifying ``what`` and ``layout`` (a new array)."""
        return _digest(self.what, self.layout).copy()

    def describe(self) -> str:
        """E.g. ``gradients step 12 (2 buckets: allreduce 4.0 MiB float32, sfb 20.5 kB
        float32)``."""
        head = self.what if self.instance is None else (
            f"{self.what} {'step' if self.what == 'gradients' else 'instance'} {self.instance}")
        if not self.layout:
            return head
        buckets = ", ".join(f"{kind} {_size(nbytes)} {dtype}"
                            for kind, nbytes, dtype in self.layout)
        plural = "s" if len(self.layout) != 1 else ""
        return f"{head} ({len(self.layout)} bucket{plural}: {buckets})"


def agree(comm, signature: Signature, timeout_s: float) -> None:
    """Collective: returns when every rank posts a signature equal to ``signature`` (up to the
    instance); raises CollectiveMismatchError on every rank otherwise, and
    CollectiveTimeoutError if some rank does not arrive within ``timeout_s``."""
    size = comm.Get_size()
    mine = signature.digest()
    everyone = np.empty((size, mine.size), np.int64)
    _wait(comm.Iallgather(mine, everyone), timeout_s, signature)
    if (everyone == everyone[0]).all():
        return
    descriptions = comm.allgather(signature.describe())
    raise CollectiveMismatchError(mismatch_message(descriptions, signature.what))


def mismatch_message(descriptions: list[str], what: str) -> str:
    """The message every rank raises: each distinct description with the ranks that posted it,
    and what usually causes it."""
    by_description: dict[str, list[int]] = {}
    for rank, description in enumerate(descriptions):
        by_description.setdefault(description, []).append(rank)
    sides = "; ".join(f"{_ranks(ranks)} posted {description}"
                      for description, ranks in by_description.items())
    message = (f"tf_poseidon: the ranks posted different collectives: {sides}. Every rank must "
               "run the same collectives in the same order.")
    if any(END_OF_PROGRAM in d for d in descriptions):
        message += (" A rank reached the end of its program while another still communicated: "
                    "code that runs fit/evaluate/predict or a strategy.reduce on some ranks "
                    "only (e.g. under `if tp.is_chief():`) must run on every rank.")
    elif any(d.startswith(TRAINING_GROUPS) for d in descriptions):
        message += (" One rank was still training while another had moved on: the ranks ran "
                    "different numbers of steps (different data on each rank: pass the same "
                    "global data to every rank, or use "
                    "strategy.distribute_datasets_from_function), or a callback or "
                    "TerminateOnNaN stopped training on some ranks only.")
    else:
        message += (" Look for a collective (evaluate, predict, strategy.reduce/gather, a "
                    "callback that reduces) that runs on some ranks only.")
    return message


def _wait(request, timeout_s: float, signature: Signature) -> None:
    """Polls ``request``: spins briefly (the common case: the peers are there), then sleeps
    between polls so that a long wait does not take a core from the computation."""
    start = time.perf_counter()
    sleep = 0.0
    while not request.Test():
        waited = time.perf_counter() - start
        if waited > timeout_s:
            raise CollectiveTimeoutError(
                f"tf_poseidon: this rank posted {signature.describe()} and waited "
                f"{timeout_s:.0f} s for the other ranks to post theirs: a peer rank has died, "
                "hangs, or runs a different program. Set TF_POSEIDON_TIMEOUT to wait longer.")
        if waited > 1e-3:
            sleep = min(max(2 * sleep, 2e-5), 5e-4)
            time.sleep(sleep)


@functools.lru_cache(maxsize=1024)
def _digest(what: str, layout: tuple) -> np.ndarray:
    text = repr((what, layout)).encode()
    return np.frombuffer(hashlib.blake2b(text, digest_size=16).digest(), np.int64)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
