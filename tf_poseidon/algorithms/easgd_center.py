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
  dtype, the variables' common numpy result type), in chunks of at most ``CHUNK_BYTES``;
* rank 0 → p, tag ``REPLY + 2·g``, chunk by chunk as each arrives: d = α(x_p − c), computed
  with the center *before* the update; then c ← c + d. The worker applies x_p ← x_p − d.

Chunks make the exchange full duplex: the replies to the first chunks travel back while the
last ones are still on their way in, so an exchange costs about one transfer of the parameters
rather than two (MPI keeps messages of one sender and tag in order, so chunk k meets chunk k).
The worker posts all its receives before its sends, so no reply waits for a matching receive;
the holder answers one worker's exchange at a time, in the order MPI matches their first
chunks. An exchange for a group rank 0 has not traced yet (it traces its train step later
than a fast worker) waits, unmatched, until that group exists.

Threads and MPI: the worker side calls MPI from the TensorFlow op that runs the exchange (an
inter-op thread), the holder from its own thread, the engine from its own thread:
``MPI_THREAD_MULTIPLE`` is required (``world.mpi_comm`` requests it; Open MPI provides it).
Every wait polls (``Test``/``Improbe``) with a sleep that grows to a few milliseconds, so a
waiting thread gives its core to TensorFlow (a blocking MPI wait would spin on it), and gives
up after :func:`~tf_poseidon.timeouts.step_s` with a message naming what it
waited for. Measured here: mpi4py's pickle-based calls (``comm.reduce``, ``comm.allgather``,
...) keep the GIL while they wait, so while rank 0 is blocked in one of them its holder thread
cannot answer; rank 0 only waits for others in buffer calls (``Barrier``, ``Bcast``) while
exchanges may be in flight (``EASGDImpl`` fetches the center that way).
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

import numpy as np

from tf_poseidon import timeouts
from tf_poseidon.comm.collectives import as_mpi_buffer
from tf_poseidon.comm.errors import CollectiveTimeoutError

EXCHANGE_TAG = 7100
REPLY_TAG = 7101
DRAIN_TAG = 7099  # below the groups' tags, which grow upward from EXCHANGE_TAG
HOLDER_RANK = 0
CHUNK_BYTES = 1 << 20

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


def chunk_bounds(num_elements: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a flat vector; one (empty) chunk for an empty vector."""
    step = max(1, CHUNK_BYTES // itemsize)
    return [(a, min(a + step, num_elements)) for a in range(0, num_elements, step)] or [(0, 0)]


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

    Created on rank 0 only, by EASGDImpl (at trace time). ``register`` and
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

    def exchange(self, group: int, x: np.ndarray, start: int = 0) -> np.ndarray:
        """One elastic exchange of ``x``, the elements [start, start + x.size) of ``group``'s
        flat vector: returns d = α(x − c) and moves c ← c + d (under the lock)."""
        with self._lock:
            full = self._centers[group]
            if x.dtype != full.dtype or start + x.size > full.size:
                raise ValueError(f"tf_poseidon EASGD: exchange of group {group} with "
                                 f"{x.size} {x.dtype} values at {start}; the center has "
                                 f"{full.size} {full.dtype}. Every rank must train the same "
                                 "model.")
            center = full[start:start + x.size]
            d = (x - center) * full.dtype.type(self._alpha)
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
        status = MPI.Status()
        sleep = _FIRST_SLEEP_S
        try:
            while not self._stop.is_set():
                with self._lock:
                    known = len(self._centers)
                # Only groups rank 0 has: a later group's chunks stay unmatched in MPI until it
                # is registered (matching its first chunk early would let a later Improbe take
                # its second chunk for a first one).
                answered = False
                for group in range(known):
                    message = self._comm.Improbe(source=MPI.ANY_SOURCE,
                                                 tag=EXCHANGE_TAG + 2 * group, status=status)
                    if message is not None:
                        self._answer(message, status.Get_source(), group,
                                     status.Get_count(MPI.BYTE))
                        answered = True
                if answered:
                    sleep = _FIRST_SLEEP_S
                else:
                    time.sleep(sleep)
                    sleep = min(2 * sleep, _LONGEST_SLEEP_S)
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
        bounds = chunk_bounds(template.size, template.dtype.itemsize)
        first = (bounds[0][1] - bounds[0][0]) * template.dtype.itemsize
        if count != first:
            raise ValueError(f"tf_poseidon EASGD: rank {source} sent a first chunk of {count} "
                             f"bytes for group {group}; the center's is {first}. Every rank "
                             "must train the same model.")
        x = np.empty(template.size, template.dtype)
        tag = EXCHANGE_TAG + 2 * group
        wire = as_mpi_buffer(x)
        receives = [message.Irecv(wire[bounds[0][0]:bounds[0][1]])] + [
            self._comm.Irecv(wire[a:b], source=source, tag=tag) for a, b in bounds[1:]]
        sends, replies = [], []
        timeout = timeouts.step_s()
        for (a, b), receive in zip(bounds, receives):
            if not _poll(receive.Test, timeout, f"the EASGD exchange from rank {source}",
                         self._stop.is_set):
                return
            d = self.exchange(group, x[a:b], a)
            replies.append(d)  # alive until its send completes
            sends.append(self._comm.Isend(as_mpi_buffer(d), dest=source,
                                          tag=REPLY_TAG + 2 * group))
        _poll(lambda: _mpi().Request.Testall(sends), timeout,
              f"the EASGD reply to rank {source}", self._stop.is_set)
        self.served.exchanges += 1
        self.served.bytes_received += x.nbytes
        self.served.bytes_sent += x.nbytes


class DrainNotices:
    """Which ranks have drained (ended a ``fit``) at a step this rank has trained past (any
    rank).

    A rank that trains (exchanges with the center) never communicates with a rank that has
    stopped, so without these messages ranks that went different ways would find it only at
    their next meeting (the end of the longer epoch). At every drain (``EASGDImpl.drain``: the
    end of ``fit``, or ``strategy.drain()``) a rank sends every other rank how many drains it
    has begun and its step count then (tag :data:`DRAIN_TAG`, on the holder's communicator); at
    each exchange a rank reads the notices that arrived. Every rank drains after the same
    number of steps in a healthy job, so a rank that has not begun that drain yet may still be
    catching up (a slower rank of a custom loop), but one that trains past that step means the
    ranks diverged. ``announce`` (main thread) and ``passed`` (an exchange's thread) never
    block.
    """

    def __init__(self, comm):
        self._comm = comm
        self._peers = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
        self._lock = threading.Lock()
        self._drains = 0                           # drains this rank has begun
        self._latest = {r: (0, 0) for r in self._peers}  # peer -> (its drains, its step)
        self._sends: list = []                     # (request, buffer) until the send completes
        self._inbox = np.empty(2, np.int64)

    def announce(self, step: int) -> None:
        """This rank begins a drain after ``step`` steps: tells every other rank."""
        with self._lock:
            self._drains += 1
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]
            for rank in self._peers:
                notice = np.array([self._drains, step], np.int64)
                self._sends.append((self._comm.Isend(notice, dest=rank, tag=DRAIN_TAG), notice))

    def passed(self, step: int) -> list[int]:
        """The ranks that have begun a drain this rank has not, at fewer steps than ``step``
        (this rank's step count at an exchange)."""
        with self._lock:
            for rank in self._peers:
                while self._comm.Iprobe(source=rank, tag=DRAIN_TAG):
                    self._comm.Irecv(self._inbox, source=rank, tag=DRAIN_TAG).Wait()  # there
                    self._latest[rank] = max(self._latest[rank], tuple(map(int, self._inbox)))
            return [rank for rank, (drains, at) in self._latest.items()
                    if drains > self._drains and at < step]


class CenterClient:
    """Ranks ≠ 0: sends x_p to the holder and waits for d (called from a TensorFlow op)."""

    def __init__(self, comm):
        self._comm = comm

    def exchange(self, group: int, x: np.ndarray, counters: ExchangeCounters) -> np.ndarray:
        """Blocks the calling thread until rank 0 answered (at most the collective timeout)."""
        reply = np.empty_like(x)
        start = time.perf_counter()
        bounds = chunk_bounds(x.size, x.dtype.itemsize)
        reply_wire, x_wire = as_mpi_buffer(reply), as_mpi_buffer(x)
        requests = [self._comm.Irecv(reply_wire[a:b], source=HOLDER_RANK,
                                     tag=REPLY_TAG + 2 * group) for a, b in bounds]
        requests += [self._comm.Isend(x_wire[a:b], dest=HOLDER_RANK,
                                      tag=EXCHANGE_TAG + 2 * group) for a, b in bounds]
        _poll(lambda: _mpi().Request.Testall(requests), timeouts.step_s(),
              "an exchange with the EASGD center holder (rank 0)")
        counters.exchanges += 1
        counters.bytes_sent += x.nbytes
        counters.bytes_received += reply.nbytes
        counters.wait_s += time.perf_counter() - start
        return reply
