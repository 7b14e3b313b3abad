"""Asynchronous EASGD's center variable: held by a thread on rank 0, exchanged point-to-point.

Who holds the center. A background thread of rank 0's process (the *holder*) keeps the center
c as flat numpy arrays and serves every other rank's exchanges over MPI point-to-point
messages on a communicator of its own (a duplicate of the world's: the engine's collectives
and these messages never match each other). Rank 0 is still a worker; its own exchanges are
function calls into the holder under the same lock. Why not a dedicated rank: the strategy
makes every process a replica (``num_replicas_in_sync`` = P, batches split P ways, metrics
summed over P ranks), and a rank that only serves would idle most of the time; the holder's
work per exchange is two vector operations on the parameters, small next to a training step,
and it sleeps (``time.sleep``, no GIL, no core) while nobody asks. Why a thread and not the
engine: the engine posts collectives in an order every rank shares, while exchanges arrive
whenever a worker reaches its period, and a slow rank must not hold back anyone's exchange.

Protocol (tags below; one pair of tags per *group*, the trainable variables of one model):

* worker p ≠ 0 → rank 0, tag ``EXCHANGE + 2·g``: x_p, its group's variables flattened (one
  dtype, the variables' common numpy result type);
* rank 0 → p, tag ``REPLY + 2·g``: d = α(x_p − c), computed with the center *before* the
  update; then c ← c + d. The worker applies x_p ← x_p − d.

The worker posts its receive before its send, so the holder's reply never waits for a matching
receive; the holder answers requests one at a time, in the order MPI matches them. A request
for a group rank 0 has not traced yet (it traces its train step later than a fast worker) is
kept and answered once that group exists.

Threads and MPI: the worker side calls MPI from the TensorFlow op that runs the exchange (an
inter-op thread), the holder from its own thread, the engine from its own thread:
``MPI_THREAD_MULTIPLE`` is required (``world.mpi_comm`` requests it; Open MPI provides it).
Every wait polls (``Test``/``Improbe``) with a sleep that grows to a few milliseconds, so a
waiting thread gives its core to TensorFlow (a blocking MPI wait would spin on it), and gives
up after :func:`~tf_poseidon.comm.engine.collective_timeout_s` with a message naming what it
waited for.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

import numpy as np

from tf_poseidon.comm.engine import CollectiveTimeoutError, collective_timeout_s

EXCHANGE_TAG = 7100
REPLY_TAG = 7101
HOLDER_RANK = 0

_FIRST_SLEEP_S = 50e-6
_LONGEST_SLEEP_S = 2e-3


def _mpi():
    from mpi4py import MPI
    return MPI


def _poll(done: Callable[[], bool], timeout_s: float, what: str,
          should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Calls ``done()`` until it returns True, sleeping between calls (growing to 2 ms).

    Returns True when done, False if ``should_stop()`` became true first. Raises
    CollectiveTimeoutError naming ``what`` after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    sleep = _FIRST_SLEEP_S
    while not done():
        if should_stop():
            return False
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"tf_poseidon EASGD: {what} did not complete within {timeout_s:.0f} s. A rank "
                "has died or hangs (or is more than that far behind). Set TF_POSEIDON_TIMEOUT "
                "to wait longer.")
        time.sleep(sleep)
        sleep = min(2 * sleep, _LONGEST_SLEEP_S)
    return True


class ExchangeCounters:
    """Bytes and exchanges of this rank's side of the protocol (thread-safe enough: ints)."""

    __slots__ = ("exchanges", "bytes_sent", "bytes_received", "wait_s")

    def __init__(self):
        self.exchanges = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_s = 0.0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class CenterHolder:
    """Rank 0: holds every group's center and serves the other ranks' exchanges on a thread.

    Created on rank 0 only, by the EASGD synchronizer (at trace time). ``register`` and
    ``exchange`` are called from TensorFlow's threads of rank 0, ``snapshot`` from the engine
    thread; the serving thread is started by the first ``register`` and stopped at exit.
    """

    def __init__(self, comm, alpha: float):
        self._comm = comm
        self._alpha = alpha
        self._centers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.served = ExchangeCounters()  # messages of other ranks answered by the thread

    def register(self, group: int, initial: np.ndarray) -> None:
        """Makes ``initial`` (copied) the center of ``group`` (0, 1, ... in order); starts the
        serving thread on the first call. Non-blocking."""
        with self._lock:
            if group != len(self._centers):
                raise RuntimeError(f"tf_poseidon EASGD: center group {group} registered out "
                                   f"of order (holder has {len(self._centers)}).")
            self._centers.append(np.array(initial, copy=True))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="tf_poseidon-easgd-center",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def exchange(self, group: int, x: np.ndarray) -> np.ndarray:
        """One elastic exchange: returns d = α(x − c) and moves c ← c + d (under the lock)."""
        with self._lock:
            center = self._centers[group]
            if x.shape != center.shape or x.dtype != center.dtype:
                raise ValueError(f"tf_poseidon EASGD: exchange of group {group} with "
                                 f"{x.size} {x.dtype} values; the center has {center.size} "
                                 f"{center.dtype}. Every rank must train the same model.")
            d = (x - center) * center.dtype.type(self._alpha)
            center += d
        return d

    def snapshot(self, group: int) -> np.ndarray:
        """A copy of ``group``'s center now."""
        with self._lock:
            return self._centers[group].copy()

    def set_center(self, group: int, value: np.ndarray) -> None:
        with self._lock:
            self._centers[group][...] = value

    def close(self) -> None:
        """Stops the serving thread (at exit, before MPI is finalized). Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- serving thread ------------------------------------------------------------------

    def _serve(self) -> None:
        MPI = _mpi()
        waiting: list[tuple[object, int, int, int]] = []  # (message, source, group, count)
        status = MPI.Status()
        sleep = _FIRST_SLEEP_S
        try:
            while not self._stop.is_set():
                message = self._comm.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG,
                                             status=status)
                if message is not None:
                    tag = status.Get_tag()
                    group = (tag - EXCHANGE_TAG) // 2
                    waiting.append((message, status.Get_source(), group,
                                    status.Get_count(MPI.BYTE)))
                with self._lock:
                    known = len(self._centers)
                ready = [w for w in waiting if w[2] < known]
                if not ready:
                    time.sleep(sleep)
                    sleep = min(2 * sleep, _LONGEST_SLEEP_S)
                    continue
                sleep = _FIRST_SLEEP_S
                for item in ready:
                    waiting.remove(item)
                    self._answer(*item)
        except BaseException as e:  # reported by the workers' timeouts and by snapshot users
            self._error = e
            import sys
            import traceback
            sys.stderr.write("[tf_poseidon rank 0] EASGD center holder stopped:\n"
                             + "".join(traceback.format_exception(e)))
            sys.stderr.flush()

    def _answer(self, message, source: int, group: int, count: int) -> None:
        with self._lock:
            template = self._centers[group]
        x = np.empty(count // template.dtype.itemsize, template.dtype)
        message.Recv(x)
        d = self.exchange(group, x)
        request = self._comm.Isend(d, dest=source, tag=REPLY_TAG + 2 * group)
        _poll(request.Test, collective_timeout_s(), f"the EASGD reply to rank {source}",
              self._stop.is_set)
        self.served.exchanges += 1
        self.served.bytes_received += x.nbytes
        self.served.bytes_sent += d.nbytes


class CenterClient:
    """Ranks ≠ 0: sends x_p to the holder and waits for d (called from a TensorFlow op)."""

    def __init__(self, comm):
        self._comm = comm

    def exchange(self, group: int, x: np.ndarray, counters: ExchangeCounters) -> np.ndarray:
        """Blocks the calling thread until rank 0 answered (at most the collective timeout)."""
        reply = np.empty_like(x)
        start = time.perf_counter()
        receive = self._comm.Irecv(reply, source=HOLDER_RANK, tag=REPLY_TAG + 2 * group)
        send = self._comm.Isend(x, dest=HOLDER_RANK, tag=EXCHANGE_TAG + 2 * group)
        requests = [send, receive]
        _poll(lambda: _mpi().Request.Testall(requests), collective_timeout_s(),
              "an exchange with the EASGD center holder (rank 0)")
        counters.exchanges += 1
        counters.bytes_sent += x.nbytes
        counters.bytes_received += reply.nbytes
        counters.wait_s += time.perf_counter() - start
        return reply
