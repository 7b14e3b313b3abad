"""Work that rank 0 does alone while the other ranks wait for it: checkpoint writes, exports.

Writing a large checkpoint or a SavedModel can take far longer than any training step, so the
waiting ranks do not wait in a collective with the step timeout. Instead, while rank 0 runs the
work, a heartbeat thread of rank 0 sends every :data:`HEARTBEAT_INTERVAL_S` a small message to
every other rank; when the work is over, rank 0 sends its outcome (the work's result, an int
≥ 0, or "failed"). The other ranks wait for the outcome as long as heartbeats keep coming, and
give up with :class:`~tf_poseidon.comm.engine.CollectiveTimeoutError`, naming the work, when

* rank 0 has been silent for the step timeout (``TF_POSEIDON_TIMEOUT``): its process is
  stopped or its Python threads are stuck; or
* the work has lasted longer than :func:`tf_poseidon.timeouts.chief_s`
  (``TF_POSEIDON_CHIEF_TIMEOUT``, default one hour), however steadily rank 0 answers.

A rank 0 that dies ends the job through Open MPI within seconds, as any rank's death does.

Every call starts with a control-plane collective on the engine thread, which checks that every
rank is at such a call (comm/agreement.py) and, on the first call, duplicates the job's
communicator. Messages travel on that duplicate, with tag :data:`HEARTBEAT_TAG`: two int64, the
call's serial number (every rank counts its calls; a mismatch means the ranks are at different
save points) and the value (:data:`ALIVE`, :data:`FAILED`, or the result). MPI keeps messages
of one sender and tag in order, so every heartbeat of a call arrives before its outcome. The
heartbeat thread and the waiting ranks' main threads call MPI while the engine thread may too:
``MPI_THREAD_MULTIPLE``, which world.py requires. Waits poll with sleeps growing to 5 ms (a
blocking MPI wait would spin a core).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

import numpy as np

from tf_poseidon import timeouts
from tf_poseidon.comm import agreement
from tf_poseidon.comm.engine import CollectiveTimeoutError, CommEngine

HEARTBEAT_TAG = 7300
HEARTBEAT_INTERVAL_S = 1.0
ALIVE = -1
FAILED = -2

_FIRST_SLEEP_S = 50e-6
_LONGEST_SLEEP_S = 5e-3


_comm = None
_serials = itertools.count(1)


def _mpi():
    from mpi4py import MPI
    return MPI


def _channel(engine: CommEngine):
    """The communicator of this module's messages, duplicated on the first call. Every call is
    a control-plane collective, agreed as every engine call is (comm/agreement.py): a rank at
    another point of its program (a save, or a checkpoint callback, run on some ranks only)
    ends the job with CollectiveMismatchError naming both points, where it would otherwise take
    the messages of another save point for this one's, or none would wait for rank 0."""
    global _comm
    _comm = timeouts.engine_call(engine, lambda comm: _comm or comm.Dup(), timeouts.step_s(),
                                 agreement.RANK0_WRITE, "TF_POSEIDON_TIMEOUT")
    return _comm


def run(engine: CommEngine, work: Callable[[], int], what: str) -> int:
    """Runs ``work()`` on rank 0 only; returns its result (an int ≥ 0) on every rank.

    Collective and blocking: every rank calls it at the same point of the program. Rank 0 runs
    ``work`` in the calling thread while its heartbeat thread reports that it is alive; the
    other ranks block until rank 0's outcome arrives (see the module docstring for how long
    they wait). When it returns on any rank, ``work`` has finished on rank 0. If ``work``
    raises on rank 0, rank 0 re-raises it and every other rank raises RuntimeError naming
    ``what`` (rank 0's output holds the reason).
    """
    comm = _channel(engine)
    serial = next(_serials)
    if comm.Get_rank() == 0:
        return _lead(comm, serial, work)
    return _follow(comm, serial, what)


def _lead(comm, serial: int, work: Callable[[], int]) -> int:
    """Rank 0: runs ``work`` with heartbeats, then sends the outcome to every rank."""
    pending: list = []  # (request, message): a message must live until its send completes
    lock = threading.Lock()

    def send(value: int) -> None:
        message = np.array([serial, value], np.int64)
        with lock:
            pending[:] = [(r, m) for r, m in pending if not r.Test()]
            pending.extend((comm.Isend(message, dest=rank, tag=HEARTBEAT_TAG), message)
                           for rank in range(1, comm.Get_size()))

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            send(ALIVE)

    heart = threading.Thread(target=beat, name="tf_poseidon-heartbeat", daemon=True)
    heart.start()
    result, error = FAILED, None
    try:
        result = work()
    except BaseException as e:  # re-raised below, once every rank knows
        error = e
    finally:
        stop.set()
        heart.join()
    if error is None and (not isinstance(result, int) or result < 0):
        error = ValueError(f"work on rank 0 returned {result!r}; expected an int >= 0.")
        result = FAILED
    send(FAILED if error is not None else result)
    limit_s = timeouts.step_s()
    deadline = time.monotonic() + limit_s
    _poll(lambda: _mpi().Request.Testall([r for r, _ in pending]),
          lambda: None if time.monotonic() < deadline else (
              f"tf_poseidon: rank 0's answer was not taken by every rank within {limit_s:.0f} "
              "s (TF_POSEIDON_TIMEOUT): a rank hangs."))
    if error is not None:
        raise error
    return result


def _follow(comm, serial: int, what: str) -> int:
    """Ranks ≠ 0: waits for rank 0's outcome while its heartbeats keep coming."""
    silence_s, limit_s = timeouts.step_s(), timeouts.chief_s()
    message = np.empty(2, np.int64)
    start = last = time.monotonic()
    request = comm.Irecv(message, source=0, tag=HEARTBEAT_TAG)

    def arrived() -> bool:
        nonlocal request, last
        while request.Test():
            if message[0] != serial:
                raise RuntimeError(
                    f"tf_poseidon: rank 0 is at its save point {message[0]} and rank "
                    f"{comm.Get_rank()} at {serial} (to {what}): the ranks do not save at the "
                    "same points of the program.")
            if message[1] != ALIVE:
                return True
            last = time.monotonic()
            request = comm.Irecv(message, source=0, tag=HEARTBEAT_TAG)
        return False

    def late() -> str | None:
        now = time.monotonic()
        if now - last > silence_s:
            return (f"tf_poseidon: rank 0 was to {what} and has sent no heartbeat for "
                    f"{silence_s:.0f} s (TF_POSEIDON_TIMEOUT): its process is stopped or "
                    "hangs.")
        if now - start > limit_s:
            return (f"tf_poseidon: rank 0 has been trying to {what} for more than "
                    f"{limit_s:.0f} s (TF_POSEIDON_CHIEF_TIMEOUT); it is alive but has not "
                    "finished.")
        return None

    try:
        _poll(arrived, late)
    except BaseException:
        request.Cancel()
        raise
    if message[1] == FAILED:
        raise RuntimeError(f"rank 0 failed to {what}; its output says why.")
    return int(message[1])


def _poll(done: Callable[[], bool], give_up: Callable[[], str | None]) -> None:
    """Calls ``done()`` until it is True, sleeping between calls; raises
    CollectiveTimeoutError as soon as ``give_up()`` returns a message (its text)."""
    sleep = _FIRST_SLEEP_S
    while not done():
        message = give_up()
        if message:
            raise CollectiveTimeoutError(message)
        time.sleep(sleep)
        sleep = min(2 * sleep, _LONGEST_SLEEP_S)
