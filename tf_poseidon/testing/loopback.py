"""An in-process communicator: the P ranks of a job as threads of one process.

For fast tests of what runs on the engine thread (comm/engine.py, the codecs, the bucket
protocols) without mpirun. ``LoopbackWorld(P).comm(rank)`` is rank ``rank``'s communicator,
with the mpi4py methods the library calls; :meth:`LoopbackWorld.run` runs a function per rank,
each on a thread of its own::

    world = LoopbackWorld(3)
    sums = world.run(lambda comm: Exact().sum_into(comm, x[comm.Get_rank()], np.empty(n)))

Each rank needs objects of its own wherever a process would have its own: a 16-bit codec
keeps wire buffers between calls, an engine its queue.

Semantics are MPI's, so that a test that passes here means what it would under mpirun:

* collectives match by order: each rank's n-th collective call on its communicator meets every
  other rank's n-th, which must be the same operation (a blocking one does not match its
  non-blocking form, as in MPI) with matching sizes, dtypes, reduction and root;
* every rank gets the same result: reductions combine in rank order, gathers concatenate in
  rank order; the data is copied when a rank joins, so buffers may be reused after a call;
* bad use raises instead of hanging: a mismatch raises :class:`LoopbackError` on every rank of
  that call; a rank waiting for a peer that never joins (or a message never sent) raises
  :class:`LoopbackTimeoutError` after ``timeout_s``; when a rank of :meth:`LoopbackWorld.run`
  fails, every other rank's wait raises at once;
* point to point: ``Isend`` is buffered (complete at once); ``Irecv`` takes the first message
  from ``source`` with ``tag`` in sending order and raises if it is longer than the buffer;
  ``Iprobe`` says whether there is one;
* buffers are C-contiguous numpy arrays of a dtype mpi4py can send (not bfloat16: view it as
  uint16, as the library does); requests have mpi4py's ``Test``, ``Wait`` and class methods
  ``Testall``, ``Waitall``.

Reductions and ``IN_PLACE`` are mpi4py's own constants (``MPI.SUM``, ``MPI.MAX``, ``MPI.MIN``,
``MPI.PROD``, ``MPI.IN_PLACE``), which the library passes. A process that imports this module
before mpi4py imports mpi4py's ``MPI`` without initialising MPI (only its constants are used),
and then cannot use real MPI.
"""

from __future__ import annotations

import collections
import functools
import operator
import pickle
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np


def _mpi_constants():
    import mpi4py
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
    from mpi4py import MPI
    return MPI


MPI = _mpi_constants()
DEFAULT_TIMEOUT_S = 20.0
DEFAULT_RUN_TIMEOUT_S = 120.0

_ARRAY_OPS = ((MPI.SUM, np.add), (MPI.MAX, np.maximum), (MPI.MIN, np.minimum),
              (MPI.PROD, np.multiply))
_OBJECT_OPS = ((MPI.SUM, operator.add), (MPI.MAX, max), (MPI.MIN, min),
               (MPI.PROD, operator.mul))


class LoopbackError(RuntimeError):
    """The ranks' calls do not match (operations, sizes, dtypes, roots), or a buffer is bad."""


class LoopbackTimeoutError(LoopbackError):
    """A rank waited ``timeout_s`` for a peer that never joined the call or sent the message."""


_PENDING = object()


class _Call:
    """One collective call of every rank: what each rank brought, and the outcome."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.brought: list = [_PENDING] * size
        self.results: list | None = None
        self.error: LoopbackError | None = None
        self.collected = 0

    def missing(self) -> list[int]:
        return [rank for rank, b in enumerate(self.brought) if b is _PENDING]


class LoopbackWorld:
    """The shared state of ``size`` ranks' communicators: calls in progress, messages in
    flight, and whether a rank failed. Every method may be called from any thread."""

    def __init__(self, size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"LoopbackWorld: size must be an integer >= 1, got {size!r}")
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._messages: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)  # (source, dest) -> (tag, bytes) in sending order
        self._failure: str | None = None
        self._comms = [LoopbackComm(self, rank) for rank in range(size)]

    def comm(self, rank: int) -> "LoopbackComm":
        """Rank ``rank``'s communicator (the same object on every call)."""
        return self._comms[rank]

    def run(self, fn: Callable[["LoopbackComm"], Any],
            timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> list[Any]:
        """Runs ``fn(comm)`` for every rank, each on a new thread; blocks until all return.

        Returns their results in rank order. If a rank raises, the others' waits are aborted
        and the first error is re-raised here. Ranks still running ``timeout_s`` after the
        start (stuck outside the communicator, whose own waits are bounded) are aborted and
        named in a LoopbackTimeoutError.
        """
        results: list[Any] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as e:  # reported by the caller's thread below
                with self._cond:
                    errors.append((rank, e))
                self.abort(f"rank {rank} failed: {e!r}")

        threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True,
                                    name=f"loopback-rank{rank}") for rank in range(self.size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [rank for rank, t in enumerate(threads) if t.is_alive()]
        if running:
            self.abort(f"rank(s) {running} did not return within {timeout_s:g} s")
            raise LoopbackTimeoutError(
                f"loopback: rank(s) {running} of {self.size} did not return within "
                f"{timeout_s:g} s (stuck outside the communicator)")
        if errors:
            raise errors[0][1]
        return results

    def abort(self, reason: str) -> None:
        """Makes every wait of every rank, now and later, raise LoopbackError with ``reason``."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()

    # -- called with self._cond held -------------------------------------------------------

    def _check_failure(self, rank: int) -> None:
        if self._failure is not None:
            raise LoopbackError(f"loopback rank {rank}: aborted ({self._failure})")

    def _join(self, sequence: int, name: str, rank: int, brought: Any,
              combine: Callable[[list], list]) -> None:
        call = self._calls.setdefault(sequence, _Call(name, self.size))
        call.brought[rank] = brought
        if call.error is None and call.name != name:
            others = [r for r in range(self.size) if r != rank and call.brought[r] is not _PENDING]
            call.error = LoopbackError(
                f"loopback: collective call #{sequence}: rank {rank} called {name} where rank(s) "
                f"{others} called {call.name}; every rank must make the same collective calls "
                "in the same order")
        if call.error is None and not call.missing():
            try:
                call.results = combine(call.brought)
            except Exception as e:  # every rank of the call raises it, none waits forever
                call.error = LoopbackError(f"loopback: {name} (collective call #{sequence}): {e}")
        self._cond.notify_all()

    def _outcome(self, sequence: int, rank: int) -> Any:
        """Rank ``rank``'s result of call ``sequence``, or _PENDING; raises the call's error."""
        call = self._calls[sequence]
        if call.error is None and call.results is None:
            return _PENDING
        call.collected += 1
        if call.collected == self.size:
            del self._calls[sequence]
        if call.error is not None:
            raise call.error
        return call.results[rank]

    def _pending_message(self, sequence: int, rank: int) -> str:
        call = self._calls[sequence]
        return (f"loopback rank {rank}: {call.name} (collective call #{sequence}) waited "
                f"{self.timeout_s:g} s for rank(s) {call.missing()}, which never made it: a "
                "rank died, hangs, or makes fewer collective calls than the others")


class Request:
    """A pending operation of a :class:`LoopbackComm`, with mpi4py's ``MPI.Request`` methods.

    ``Test`` never blocks; ``Wait`` blocks until the request completes. Either raises
    LoopbackTimeoutError once the request has been pending for the world's ``timeout_s`` (so
    that polling with Test, too, ends). The result is written into the receive buffer when the
    request completes.
    """

    def __init__(self, world: LoopbackWorld, rank: int,
                 poll: Callable[[], Any], describe: Callable[[], str],
                 deliver: Callable[[Any], None]):
        self._world, self._rank = world, rank
        self._poll, self._describe, self._deliver = poll, describe, deliver
        self._deadline = time.monotonic() + world.timeout_s
        self._done = False

    def Test(self, status=None) -> bool:
        if not self._done:
            self._progress(block=False)
        return self._done

    def Wait(self, status=None) -> None:
        if not self._done:
            self._progress(block=True)

    def _progress(self, block: bool) -> None:
        world = self._world
        with world._cond:
            while True:
                world._check_failure(self._rank)
                value = self._poll()
                left = self._deadline - time.monotonic()
                if value is not _PENDING:
                    break
                if left <= 0:
                    raise LoopbackTimeoutError(self._describe())
                if not block:
                    return
                world._cond.wait(left)
        self._done = True
        self._deliver(value)

    @classmethod
    def Testall(cls, requests: Sequence["Request"], statuses=None) -> bool:
        """True when every request is complete (each is tested, so each makes progress)."""
        return all([request.Test() for request in requests])

    @classmethod
    def Waitall(cls, requests: Sequence["Request"], statuses=None) -> None:
        for request in requests:
            request.Wait()


def _flat(buffer: Any, what: str) -> np.ndarray:
    """``buffer`` as a 1-D view, or a clear error where mpi4py would refuse it."""
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"loopback {what}: takes numpy arrays, got {type(buffer).__name__}")
    if not buffer.flags.c_contiguous:
        raise ValueError(f"loopback {what}: the buffer must be C-contiguous")
    try:
        memoryview(buffer)
    except (TypeError, ValueError, BufferError) as e:
        raise TypeError(f"loopback {what}: mpi4py cannot send a {buffer.dtype} array ({e}); "
                        "send its bits as integers of the same size instead "
                        "(bfloat16: .view(np.uint16))") from None
    return buffer.reshape(-1)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def _equal(values: Sequence[Any], what: str) -> Any:
    """The one value every rank gave; raises LoopbackError naming each rank's if not."""
    if any(v != values[0] for v in values[1:]):
        raise LoopbackError(f"ranks disagree on {what}: " + ", ".join(
            f"rank {r}: {v}" for r, v in enumerate(values)))
    return values[0]


def _find(table, op, what: str):
    for known, function in table:
        if op == known:
            return function
    raise LoopbackError(f"{what}: reduction {op!r} is not supported (SUM, MAX, MIN, PROD)")


class LoopbackComm:
    """One rank's communicator (see the module docstring). Methods follow mpi4py's names and
    signatures; like an MPI communicator, one thread at a time should make its calls."""

    def __init__(self, world: LoopbackWorld, rank: int):
        self._world = world
        self._rank = rank
        self._sequence = 0

    def __repr__(self) -> str:
        return f"LoopbackComm(rank={self._rank}, size={self._world.size})"

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._world.size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    # -- the machinery of every collective -------------------------------------------------

    def _collective(self, name: str, brought: Any, combine: Callable[[list], list],
                    deliver: Callable[[Any], None]) -> Request:
        """Joins this rank's next collective call with ``brought``; ``combine`` (run once, on
        the last rank to join, with every rank's ``brought``) gives each rank's result or
        raises LoopbackError; ``deliver`` takes this rank's."""
        world = self._world
        with world._cond:
            world._check_failure(self._rank)
            sequence = self._sequence
            self._sequence += 1
            world._join(sequence, name, self._rank, brought, combine)
        return Request(world, self._rank, lambda: world._outcome(sequence, self._rank),
                       lambda: world._pending_message(sequence, self._rank), deliver)

    # -- array collectives -----------------------------------------------------------------

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        return self._allreduce("Iallreduce", sendbuf, recvbuf, op)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        self._allreduce("Allreduce", sendbuf, recvbuf, op).Wait()

    def _allreduce(self, name, sendbuf, recvbuf, op) -> Request:
        out = _flat(recvbuf, name)
        data = out.copy() if sendbuf is MPI.IN_PLACE else _flat(sendbuf, name).copy()
        if data.size != out.size or data.dtype != out.dtype:
            raise ValueError(f"loopback {name}: send buffer ({data.size} x {data.dtype}) and "
                             f"receive buffer ({out.size} x {out.dtype}) differ")
        _find(_ARRAY_OPS, op, name)

        def combine(brought):
            _equal([(d.size, d.dtype.str) for d, _ in brought], "(count, dtype)")
            function = _find(_ARRAY_OPS, _equal([o for _, o in brought], "the reduction"), name)
            total = functools.reduce(function, [d for d, _ in brought])
            return [total] * len(brought)
        return self._collective(name, (data, op), combine,
                                functools.partial(np.copyto, out))

    def Ialltoall(self, sendbuf, recvbuf) -> Request:
        return self._alltoall("Ialltoall", sendbuf, recvbuf)

    def Alltoall(self, sendbuf, recvbuf) -> None:
        self._alltoall("Alltoall", sendbuf, recvbuf).Wait()

    def _alltoall(self, name, sendbuf, recvbuf) -> Request:
        send, out = _bytes(_flat(sendbuf, name)), _bytes(_flat(recvbuf, name))
        size = self._world.size
        if send.size != out.size or send.size % size:
            raise ValueError(f"loopback {name}: send ({send.size} bytes) and receive "
                             f"({out.size} bytes) buffers must be equal and split into {size} "
                             "blocks")

        def combine(brought):
            nbytes = _equal([b.size for b in brought], "the bytes sent")
            block = nbytes // size
            return [np.concatenate([b[r * block:(r + 1) * block] for b in brought])
                    for r in range(size)]
        return self._collective(name, send.copy(), combine, functools.partial(np.copyto, out))

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        return self._allgather("Iallgather", sendbuf, recvbuf)

    def Allgather(self, sendbuf, recvbuf) -> None:
        self._allgather("Allgather", sendbuf, recvbuf).Wait()

    def _allgather(self, name, sendbuf, recvbuf) -> Request:
        send, out = _bytes(_flat(sendbuf, name)), _bytes(_flat(recvbuf, name))
        if out.size != self._world.size * send.size:
            raise ValueError(f"loopback {name}: the receive buffer ({out.size} bytes) must hold "
                             f"{self._world.size} x the send buffer ({send.size} bytes)")

        def combine(brought):
            _equal([b.size for b in brought], "the bytes sent")
            return [np.concatenate(brought)] * len(brought)
        return self._collective(name, send.copy(), combine, functools.partial(np.copyto, out))

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        """``recvbuf``: ``[array, (counts, displacements)]``, ``[array, counts,
        displacements]`` or ``[array, counts]`` (packed in rank order), counts and
        displacements in elements of ``array``."""
        name = "Allgatherv"
        if not isinstance(recvbuf, (list, tuple)) or len(recvbuf) not in (2, 3):
            raise TypeError(f"loopback {name}: recvbuf must be [array, (counts, displacements)]"
                            f", [array, counts, displacements] or [array, counts], got "
                            f"{type(recvbuf).__name__}")
        array = recvbuf[0]
        rest = recvbuf[1:]
        if len(rest) == 1 and isinstance(rest[0], tuple) and len(rest[0]) == 2:
            rest = rest[0]
        counts = np.asarray(rest[0], np.int64).reshape(-1)
        displacements = (np.asarray(rest[1], np.int64).reshape(-1) if len(rest) > 1 else
                         np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64))
        send, out = _flat(sendbuf, name), _flat(array, name)
        size, item = self._world.size, out.dtype.itemsize
        if counts.size != size or displacements.size != size:
            raise ValueError(f"loopback {name}: needs {size} counts and displacements, got "
                             f"{counts.size} and {displacements.size}")
        if np.any(counts < 0) or np.any(displacements < 0) or np.any(
                displacements + counts > out.size):
            raise ValueError(f"loopback {name}: counts {counts.tolist()} at displacements "
                             f"{displacements.tolist()} do not fit a buffer of {out.size}")
        if send.nbytes != counts[self._rank] * item:
            raise ValueError(f"loopback {name}: rank {self._rank} sends {send.nbytes} bytes but "
                             f"its own count says {counts[self._rank] * item}")
        data = _bytes(send).copy()

        def combine(brought):
            sent = [b[0].size for b in brought]
            for rank, (_, expected) in enumerate(brought):
                if list(expected) != sent:
                    raise LoopbackError(f"rank {rank}'s receive counts (bytes {list(expected)}) "
                                        f"differ from what the ranks send (bytes {sent})")
            return [[b[0] for b in brought]] * len(brought)

        def deliver(pieces):
            raw = _bytes(out)
            for piece, at in zip(pieces, displacements * item):
                raw[at:at + piece.size] = piece
        self._collective(name, (data, (counts * item).tolist()), combine, deliver).Wait()

    def Bcast(self, buf, root: int = 0) -> None:
        name = "Bcast"
        self._check_peer(root, name)
        data = _bytes(_flat(buf, name))
        mine = data.copy() if self._rank == root else None

        def combine(brought):
            _equal([r for r, _, _ in brought], "the root")
            _equal([n for _, n, _ in brought], "the bytes")
            return [brought[root][2]] * len(brought)
        self._collective(name, (root, data.size, mine), combine,
                         functools.partial(np.copyto, data)).Wait()

    def Ibarrier(self) -> Request:
        return self._collective("Ibarrier", None, lambda b: [None] * len(b), lambda _: None)

    def Barrier(self) -> None:
        self._collective("Barrier", None, lambda b: [None] * len(b), lambda _: None).Wait()

    # -- Python objects (pickled, as mpi4py does) -------------------------------------------

    def _objects(self, name: str, brought: Any, combine: Callable[[list], Any]) -> Any:
        box = []
        self._collective(name, brought, lambda b: [combine(b)] * len(b), box.append).Wait()
        return pickle.loads(box[0])

    def allgather(self, obj: Any) -> list:
        return self._objects("allgather", pickle.dumps(obj),
                             lambda b: pickle.dumps([pickle.loads(p) for p in b]))

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        self._check_peer(root, "bcast")

        def combine(brought):
            _equal([r for r, _ in brought], "the root")
            return brought[root][1]
        return self._objects("bcast", (root, pickle.dumps(obj) if self._rank == root else None),
                             combine)

    def allreduce(self, obj: Any, op=MPI.SUM) -> Any:
        _find(_OBJECT_OPS, op, "allreduce")

        def combine(brought):
            function = _find(_OBJECT_OPS, _equal([o for o, _ in brought], "the reduction"),
                             "allreduce")
            return pickle.dumps(functools.reduce(function, [pickle.loads(p) for _, p in brought]))
        return self._objects("allreduce", (op, pickle.dumps(obj)), combine)

    # -- point to point ----------------------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._world.size:
            raise ValueError(f"loopback {what}: no rank {peer} in a world of "
                             f"{self._world.size}")

    def Isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Buffered: the data is copied now and the request is complete."""
        self._check_peer(dest, "Isend")
        data = _bytes(_flat(buf, "Isend")).copy()
        world = self._world
        with world._cond:
            world._check_failure(self._rank)
            world._messages[self._rank, dest].append((tag, data))
            world._cond.notify_all()
        return Request(world, self._rank, lambda: None, lambda: "", lambda _: None)

    def Iprobe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> bool:
        """Whether a message from ``source`` with ``tag`` is there to receive. Never blocks."""
        world = self._world
        sources = range(world.size) if source == MPI.ANY_SOURCE else [source]
        with world._cond:
            return any(tag == MPI.ANY_TAG or sent_tag == tag for s in sources
                       for sent_tag, _ in world._messages.get((s, self._rank), ()))

    def Irecv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Request:
        if source != MPI.ANY_SOURCE:
            self._check_peer(source, "Irecv")
        out = _bytes(_flat(buf, "Irecv"))
        world, rank = self._world, self._rank
        sources = range(world.size) if source == MPI.ANY_SOURCE else [source]

        def poll():
            for s in sources:
                queue = world._messages.get((s, rank))
                for position, (sent_tag, data) in enumerate(queue or ()):
                    if tag == MPI.ANY_TAG or sent_tag == tag:
                        del queue[position]
                        if data.size > out.size:
                            raise LoopbackError(
                                f"loopback Irecv on rank {rank}: a message of {data.size} bytes "
                                f"from rank {s} (tag {sent_tag}) does not fit the {out.size}-byte "
                                "buffer (MPI_ERR_TRUNCATE)")
                        return data
            return _PENDING

        def deliver(data):
            out[:data.size] = data
        def describe():
            sender = "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"
            return (f"loopback rank {rank}: Irecv from {sender} (tag "
                    f"{'any' if tag == MPI.ANY_TAG else tag}) got no message within "
                    f"{world.timeout_s:g} s: the peer never sent it")
        return Request(world, rank, poll, describe, deliver)

    def Sendrecv(self, sendbuf, dest: int, sendtag: int = 0, recvbuf=None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG, status=None) -> None:
        receive = self.Irecv(recvbuf, source, recvtag)
        self.Isend(sendbuf, dest, sendtag)
        receive.Wait()
