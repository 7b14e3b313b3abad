"""The communication engine: the one thread per process that owns MPI.

TensorFlow runs independent graph ops concurrently on its inter-op threads, so the order in
which gradients become ready differs between ranks. MPI collectives, however, must be posted in
the same order on every rank. The engine reconciles the two:

* Graph ops (see :mod:`tf_poseidon.comm.graph_ops`) hand it *bucket payloads* as soon as they
  exist, without waiting (:meth:`CommEngine.submit`).
* The engine posts them in a canonical order that is the same on every rank: *group instances*
  in the order their first payload arrived, and within a group instance, buckets in index
  order (bucket 0 first). A group instance is one execution of a traced collective call (one
  training step's gradient reduction, one metric reduction, ...).
* Results are delivered per (group, bucket) in FIFO order to whoever waits for them
  (:meth:`CollectiveGroup.wait_result`).

Why the group order is the same on every rank: the enqueue ops of one function run in creation
order (they are stateful; see graph_ops.py), functions run one at a time, and eager calls are
sequential. The engine never reorders across groups.

Control-plane work (the initial broadcast, descriptor checks) goes through the same queue with
:meth:`CommEngine.call`, so it, too, is ordered with the data plane.

Before it posts a group instance or runs a call, the engine checks that every rank posts the
same (comm/agreement.py: one 16-byte all-gather); a mismatch raises on every rank, naming what
each posted, instead of summing unrelated buffers or hanging. At exit every rank posts "end of
program" the same way, so a rank still communicating learns that a peer has finished
(:meth:`CommEngine.end_of_program`). After a failure the engine fails every later collective
with the same error.

A rank that has reached the end of its program waits there for the others, which may still be
working alone (rank 0 writing files after training, a rank of asynchronous EASGD still stepping).
To tell a working peer from a stuck one, it tells every other rank that it has arrived (a
point-to-point message of tag :data:`EXIT_TAG` on the engine's communicator), and the engine
thread of every rank not there yet answers, while it is idle, with a heartbeat (tag
:data:`ALIVE_TAG`) every :data:`HEARTBEAT_INTERVAL_S`. The waiting rank gives up when a peer has
been silent for the step timeout (its process is stopped, or something holds Python's GIL), or
when the wait has lasted :func:`tf_poseidon.timeouts.meeting_s` however steadily the heartbeats
come (a peer alive but stuck: a deadlock of its own threads, an endless loop).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tf_poseidon import timeouts, world
from tf_poseidon.comm import stats as stats_lib
from tf_poseidon.comm import timeline as timeline_lib
from tf_poseidon.comm import agreement, autotune
from tf_poseidon.comm.buckets import Bucket
from tf_poseidon.comm.errors import CollectiveMismatchError, CollectiveTimeoutError
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult

ENGINE_REPORT_GRACE_S = 2.0
"""How much longer a caller waits for a result than the engine waits for its peers."""
EXIT_TAG = 7400
"""Tag of "this rank has reached the end of its program" (module docstring)."""
ALIVE_TAG = 7401
"""Tag of a heartbeat to a rank waiting at the end of its program: alive, not there yet."""
HEARTBEAT_INTERVAL_S = 1.0
_EXIT_PROBE_S = 0.05  # how often a rank at the end of its program looks for messages


class CollectiveGroup:
    """The buckets of one traced collective call, their protocols, and their result queues.

    Created at trace time (one per reduction or gather call site of a traced function) and on
    every eager call, by ``graph_ops.run_buckets``. ``buckets`` is the plan (comm/buckets.py);
    ``protocols`` maps each bucket kind to the protocol that runs it on the engine thread
    (comm/protocol.py).
    """

    _ids = itertools.count()

    def __init__(self, name: str, buckets: Sequence[Bucket],
                 protocols: Mapping[str, BucketProtocol],
                 tuner: "autotune.GradientTuner | None" = None):
        missing = {b.kind for b in buckets} - set(protocols)
        if missing:
            raise ValueError(f"collective {name!r}: no protocol for bucket kinds {missing}")
        self.id = next(self._ids)
        self.name = name
        self.buckets = tuple(buckets)
        self.protocols = dict(protocols)
        self.tuner = tuner  # chooses each instance's engine-side setting (comm/autotune.py)
        self._layout = tuple((b.kind, b.payload_bytes, b.payload_dtype.name) for b in buckets)
        self.num_buckets = len(self.buckets)
        self._results = [queue.SimpleQueue() for _ in range(self.num_buckets)]
        self._arrivals = [0] * self.num_buckets
        self._instances_started = 0

    def signature(self, instance: int) -> agreement.Signature:
        """What posting instance ``instance`` of this group is, for the ranks to agree on."""
        return agreement.Signature(self.name, instance, self._layout)

    def _fail(self, error: BaseException) -> None:
        """Every bucket's next waiter gets ``error`` (engine thread)."""
        for results in self._results:
            results.put(error)

    def __repr__(self) -> str:
        return f"CollectiveGroup({self.name!r}, id={self.id}, buckets={self.num_buckets})"

    def poll_result(self, index: int) -> np.ndarray | None:
        """Bucket ``index``'s next result if it is there already, else None. Never blocks."""
        try:
            result = self._results[index].get_nowait()
        except queue.Empty:
            return None
        if isinstance(result, BaseException):
            raise result
        return result

    def wait_result(self, index: int, timeout_s: float | None = None) -> np.ndarray:
        """Blocks the calling thread until bucket ``index``'s next result is there.

        Called from graph ops (any thread but the engine's). Raises CollectiveTimeoutError
        after ``timeout_s`` (default: ``timeouts.step_s()``), or re-raises the error
        the engine met while running this bucket. The engine's own wait for its peers
        (agreement.agree, which names the step a missing peer did not post) has the same
        limit and starts first; this wait gives it ENGINE_REPORT_GRACE_S more to deliver
        that error, so the precise message wins, and fails by itself only when the engine
        thread is stuck inside MPI.
        """
        timeout_s = timeouts.step_s() if timeout_s is None else timeout_s
        try:
            result = self._results[index].get(timeout=timeout_s + ENGINE_REPORT_GRACE_S)
        except queue.Empty:
            raise CollectiveTimeoutError(
                f"tf_poseidon: bucket {index} of collective {self.name!r} did not complete "
                f"within {timeout_s:.0f} s. A peer rank has died, hangs, or runs a different "
                "program (different models or a different number of steps). Set "
                "TF_POSEIDON_TIMEOUT to wait longer.") from None
        if isinstance(result, BaseException):
            raise result
        return result


@dataclasses.dataclass
class _BucketJob:
    group: CollectiveGroup
    index: int
    payload: np.ndarray
    submitted_at: float
    instance: int = -1


@dataclasses.dataclass
class _CallJob:
    fn: Callable[[Any], Any]
    done: threading.Event
    label: str
    timeout_s: float
    # Engine thread, just before the agreement: makes the agreement's give_up (None: timeout_s).
    patience: Callable[[], Callable[[], str | None]] | None = None
    result: Any = None


class CommEngine:
    """Owns the MPI communicator; runs every collective of this process on one thread.

    One per process (see :func:`get_engine`). All methods may be called from any thread except
    the engine's own.
    """

    def __init__(self, comm, timeline: "timeline_lib.Timeline | None" = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.stats = stats_lib.CommStats()
        self.timeline = timeline
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._exits = _ExitHeartbeats(comm)
        self.training_groups: frozenset[str] = frozenset()
        self._thread = threading.Thread(target=self._loop, name="tf_poseidon-comm", daemon=True)
        self._thread.start()

    def submit(self, group: CollectiveGroup, index: int, payload: np.ndarray) -> None:
        """Hands bucket ``index`` of ``group`` to the engine. Never blocks.

        ``payload`` must not be modified by the caller afterwards.
        """
        self._jobs.put(_BucketJob(group, index, payload, time.perf_counter()))

    def declare_training_groups(self, names: Iterable[str]) -> None:
        """Adds ``names`` (groups and calls that training steps post: the algorithm's
        ``training_groups``) to those a mismatch report calls training (comm/agreement.py).
        Any thread; never blocks."""
        self.training_groups = self.training_groups | frozenset(names)

    def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None,
             label: str | None = None) -> Any:
        """Runs ``fn(comm)`` on the engine thread after all work submitted before it.

        Blocks the caller until it returns (at most ``timeout_s``, default
        ``timeouts.step_s()``, and ENGINE_REPORT_GRACE_S for the engine to report); returns
        its result or re-raises its exception. Every rank must make the same sequence of
        calls, like any MPI collective: the ranks first agree that they all run a call of the
        same ``label`` (default: ``fn``'s name), waiting for each other at most ``timeout_s``
        too.
        """
        timeout_s = timeouts.step_s() if timeout_s is None else timeout_s
        label = label or getattr(fn, "__name__", "call")
        return self._finish(_CallJob(fn, threading.Event(), label, timeout_s))

    def end_of_program(self) -> None:
        """Every rank, at the end of its program (``atexit`` calls it for the process's
        engine): blocks until every rank has called it, after all work submitted before it.

        Raises CollectiveMismatchError (on every rank) if a rank posts anything else
        meanwhile, and CollectiveTimeoutError when a rank not there yet has sent no heartbeat
        for ``timeouts.step_s()`` or the wait has lasted ``timeouts.meeting_s()`` (module
        docstring).
        """
        limit_s, silence_s = timeouts.meeting_s(), timeouts.step_s()
        self._finish(_CallJob(lambda comm: self._exits.flush(silence_s), threading.Event(),
                              agreement.END_OF_PROGRAM, limit_s,
                              lambda: self._exits.arrive(limit_s, silence_s)))

    def _finish(self, job: _CallJob) -> Any:
        """Queues ``job`` and blocks until the engine has run it (at most its timeout and
        ENGINE_REPORT_GRACE_S); its result, or its error raised."""
        self._jobs.put(job)
        if not job.done.wait(job.timeout_s + ENGINE_REPORT_GRACE_S):
            raise CollectiveTimeoutError(
                f"tf_poseidon: the control-plane call {job.label!r} did not complete within "
                f"{job.timeout_s:.0f} s; a peer rank has died, hangs, or runs a different "
                "program. Set TF_POSEIDON_TIMEOUT to wait longer.")
        if isinstance(job.result, BaseException):
            raise job.result
        return job.result

    # -- engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        # Payloads that arrived before their turn, keyed by (group id, instance, bucket).
        stash: dict[tuple[int, int, int], _BucketJob] = {}
        # Group instances in the order their first payload arrived: (group, instance number).
        order: collections.deque[tuple[CollectiveGroup, int]] = collections.deque()
        next_bucket = 0
        setting = None  # the head instance's, once it has started
        while True:
            # Post every bucket whose turn has come.
            while order:
                group, instance = order[0]
                if setting is None:
                    first = stash.get((group.id, instance, 0))
                    if first is None:
                        break
                    self._agree(group.signature(instance))
                    setting = self._begin(group, first.submitted_at)
                if not setting.overlap and any((group.id, instance, k) not in stash
                                               for k in range(next_bucket, group.num_buckets)):
                    break  # overlap off: the whole step first
                job = stash.pop((group.id, instance, next_bucket), None)
                if job is None:
                    break
                if self._failure is not None:
                    group._fail(self._failure)
                    order.popleft()
                    stash = {k: v for k, v in stash.items() if k[:2] != (group.id, instance)}
                    next_bucket, setting = 0, None
                    continue
                self._run_bucket(job, setting)
                next_bucket += 1
                if next_bucket == group.num_buckets:
                    order.popleft()
                    next_bucket, setting = 0, None
            try:
                job = self._jobs.get(timeout=self._exits.until_next_answer())
            except queue.Empty:
                job = None
            self._answer_exits()
            if job is None:
                continue
            if isinstance(job, _CallJob):
                self._run_call(job)
                continue
            group = job.group
            instance = group._arrivals[job.index]
            group._arrivals[job.index] += 1
            if instance == group._instances_started:
                group._instances_started += 1
                order.append((group, instance))
            job.instance = instance
            stash[(group.id, instance, job.index)] = job

    def _begin(self, group: CollectiveGroup, started_at: float) -> "autotune.Setting":
        """The setting of a group instance about to be posted: its tuner's (which may agree
        with the other ranks, at the same instance on every rank), else the default."""
        if group.tuner is None or self._failure is not None:
            return autotune.DEFAULT
        try:
            return group.tuner.begin(self.comm, group._layout, started_at)
        except BaseException as e:  # an MPI failure: every later collective fails with it
            self._failure = e
            return autotune.DEFAULT

    def _run_bucket(self, job: _BucketJob, setting: "autotune.Setting") -> None:
        group = job.group
        bucket = group.buckets[job.index]
        codec = group.tuner.codec_of(setting, job.index) if group.tuner is not None else None
        start = time.perf_counter()
        try:
            result = group.protocols[bucket.kind].run(self.comm, BucketCall(
                group.name, group.id, job.instance, bucket, job.payload, codec))
        except BaseException as e:  # delivered to the waiting graph op, which raises it
            result = BucketResult(RuntimeError(
                f"tf_poseidon: collective {group.name!r} bucket {job.index} failed on rank "
                f"{self.rank}: {e!r}"), 0.0, 0.0)
        end = time.perf_counter()
        if group.tuner is not None:
            group.tuner.bucket_done(group._layout, job.index, end - start)
        item_bytes = result.item_bytes or tuple(
            n * bucket.payload_dtype.itemsize for n in bucket.sizes)
        self.stats.record(stats_lib.BucketRecord(
            group.name, group.id, job.instance, job.index,
            tuple(zip(bucket.names, item_bytes)), job.payload.nbytes, result.bytes_sent,
            result.bytes_received, job.submitted_at, start, end))
        if self.timeline is not None:
            self.timeline.bucket(group.name, job.index, job.payload.nbytes, job.submitted_at,
                                 start, end)
        group._results[job.index].put(result.value)

    def _run_call(self, job: _CallJob) -> None:
        self._agree(agreement.Signature(job.label, None, call=True), job.timeout_s,
                    job.patience)
        try:
            if self._failure is not None:
                raise self._failure
            job.result = job.fn(self.comm)
        except BaseException as e:
            job.result = e
        job.done.set()

    def _agree(self, signature: agreement.Signature, timeout_s: float | None = None,
               patience: Callable[[], Callable[[], str | None]] | None = None) -> None:
        """Checks with the other ranks (agreement.agree; ``timeout_s`` default
        ``timeouts.step_s()``; ``patience()`` makes its give_up) unless the engine has failed
        already; a mismatch, a timeout or a bad timeout setting becomes the engine's
        failure."""
        if self._failure is not None:
            return
        try:
            agreement.agree(self.comm, signature,
                            timeouts.step_s() if timeout_s is None else timeout_s,
                            self.training_groups, patience() if patience else None)
        except (CollectiveMismatchError, CollectiveTimeoutError, ValueError) as e:
            self._failure = e

    def _answer_exits(self) -> None:
        """Heartbeats to the ranks waiting at the end of their program (_ExitHeartbeats.answer);
        an MPI error there becomes the engine's failure."""
        try:
            self._exits.answer()
        except Exception as e:  # noqa: BLE001 - MPI is broken: every later collective says so
            if self._failure is None:
                self._failure = e


class _ExitHeartbeats:
    """The end-of-program messages of one rank (module docstring). Engine thread only; no
    method blocks except :meth:`flush` (bounded).

    ``answer`` runs while the engine is idle: every HEARTBEAT_INTERVAL_S it collects the
    EXIT notices that arrived and sends a heartbeat to each rank that has sent one. At its own
    end of program a rank calls ``arrive`` (sends its EXIT notices; returns the give_up of the
    agreement that waits for the others), then ``flush`` once every rank is there.
    """

    def __init__(self, comm):
        self._comm = comm
        self._peers = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
        self._exited: set[int] = set()  # peers that have reached the end of their program
        self._sends: list = []          # (request, buffer): a buffer lives until its send ends
        self._next_answer = 0.0
        self._inbox = np.empty(1, np.int64)

    def _send(self, rank: int, tag: int) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        buffer = np.zeros(1, np.int64)
        self._sends.append((self._comm.Isend(buffer, dest=rank, tag=tag), buffer))

    def _arrived(self, tag: int) -> list[int]:
        """The peers whose messages of ``tag`` have arrived (each received, once per message)."""
        senders = []
        for rank in self._peers:
            while self._comm.Iprobe(source=rank, tag=tag):
                self._comm.Irecv(self._inbox, source=rank, tag=tag).Wait()  # it is there
                senders.append(rank)
        return senders

    def until_next_answer(self) -> float:
        """Seconds until ``answer`` is due (at most HEARTBEAT_INTERVAL_S): how long the idle
        engine may wait for work."""
        return min(max(self._next_answer - time.monotonic(), 0.0), HEARTBEAT_INTERVAL_S)

    def answer(self) -> None:
        now = time.monotonic()
        if now < self._next_answer:
            return
        self._next_answer = now + HEARTBEAT_INTERVAL_S
        self._exited.update(self._arrived(EXIT_TAG))
        for rank in self._exited:
            self._send(rank, ALIVE_TAG)

    def arrive(self, limit_s: float, silence_s: float) -> Callable[[], str | None]:
        """Tells every other rank that this one has reached the end of its program; returns
        the give_up of the wait for them: a message once a peer not there yet has been silent
        for ``silence_s``, or after ``limit_s`` in all."""
        for rank in self._peers:
            self._send(rank, EXIT_TAG)
        start = time.monotonic()
        heard = dict.fromkeys(self._peers, start)
        probed = [start]

        def give_up() -> str | None:
            now = time.monotonic()
            if now - probed[0] < _EXIT_PROBE_S:
                return None
            probed[0] = now
            self._exited.update(self._arrived(EXIT_TAG))
            for rank in self._arrived(ALIVE_TAG):
                heard[rank] = now
            missing = [r for r in self._peers if r not in self._exited]
            silent = [r for r in missing if now - heard[r] > silence_s]
            if silent:
                return (f"tf_poseidon: this rank has reached the end of its program and waits "
                        f"for {agreement.rank_list(silent)}, which sent no heartbeat for "
                        f"{silence_s:.0f} s (TF_POSEIDON_TIMEOUT): a stopped process, or one "
                        "whose Python threads cannot run.")
            if now - start > limit_s:
                return (f"tf_poseidon: this rank has reached the end of its program and has "
                        f"waited {limit_s:.0f} s (TF_POSEIDON_MEETING_TIMEOUT) for "
                        f"{agreement.rank_list(missing)}, alive but not at the end of the "
                        "program: stuck (a deadlock, an endless loop), or working alone for "
                        "longer than that.")
            return None
        return give_up

    def flush(self, timeout_s: float) -> None:
        """Waits until this rank's messages have left (at most ``timeout_s``): MPI must not be
        finalized with sends in progress. The peers' last heartbeats need not be received."""
        deadline = time.monotonic() + timeout_s
        while not all(r.Test() for r, _ in self._sends):
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"tf_poseidon: this rank's end-of-program messages were not delivered "
                    f"within {timeout_s:.0f} s (TF_POSEIDON_TIMEOUT): a rank hangs.")
            time.sleep(1e-3)
        self._sends = []


_engine: CommEngine | None = None
_engine_lock = threading.Lock()


def get_engine() -> CommEngine:
    """The process's engine, started on first use (initialises MPI). Only when size() > 1.

    With ``TF_POSEIDON_TIMELINE=<file>`` set (``PoseidonStrategy(timeline=...)`` and
    ``tfposeidon-run --timeline-filename`` set it), the engine records a Chrome trace that rank
    0 writes to that file when the process exits (timeline.py).
    """
    global _engine
    with _engine_lock:
        if _engine is None:
            comm = world.mpi_comm()
            path = os.environ.get("TF_POSEIDON_TIMELINE")
            timeline = timeline_lib.Timeline(comm.Get_rank(), path) if path else None
            _engine = CommEngine(comm, timeline)
            if timeline is not None:
                timeline.write_at_exit(_engine)
            atexit.register(_end_of_program, _engine)
        return _engine


def _end_of_program(engine: CommEngine) -> None:
    """At exit (main thread): ``engine.end_of_program()``; a mismatch or a timeout there makes
    this rank print its cause as an uncaught exception's (world.py: the launcher repeats it)
    and abort the job (an exception in an exit handler would exit with 0)."""
    try:
        engine.end_of_program()
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        sys.stderr.write(f"[tf_poseidon rank {engine.rank}] {world.ABORT_MARK} "
                         f"{world.fault_summary(e)}\n")
        sys.stderr.flush()
        engine.comm.Abort(1)
