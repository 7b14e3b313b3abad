"""Stale synchronous parallel (mode="ssp", staleness=s): bounded-staleness delta exchange.

Ho et al.'s SSP, realised with collectives instead of a parameter server. What travels is each
rank's *parameter update* (what its optimizer did to the variables, from its own, local-mean
gradients), averaged over ranks: the weights every rank converges to are

    W = W_0 + Σ_t (1/P) Σ_p Δ_p(t).

Each rank's optimizer updates its variables from its local gradient (so its optimizer state —
momentum, Adam moments — follows its own gradients, as a worker's does in SSP) and keeps its own
updates in full until the others' arrive (an SSP worker reads its own writes). The steps go in
*batches* of m = ⌊(s+1)/2⌋ consecutive steps (m = 1 for s <= 2), one exchange per batch, at most
one in flight; per bucket a rank holds two buffers of the parameters' size, whatever s: the
*base* (its variables' values where the current batch began) and the batch in flight. At the
batch's last step, after the optimizer's update, rank p

1. turns the base into its batch update d_p = W − base (in place, one pass) and hands it to
   the engine, which sums it over ranks and turns it, chunk by chunk and in place, into the
   correction c_p = (Σ_q d_q)/P − d_p: the average less the own update W already holds;
2. waits for the previous batch's correction (sent m steps before: the staleness bound's
   wait, at most the collective timeout) and applies it, W += c (in place), then copies the
   new W into the freed buffer: the next batch's base.

So the others' updates of step t are applied at the latest in step t + 2m − 1 <= t + s, a rank
runs at most about m steps ahead of the slowest before it blocks, and every update is applied
exactly once on every rank: after a drain (the partial batch exchanged and everything applied:
end of ``fit``, before ``evaluate``/``predict``/saving, and ``strategy.drain()``) the replicas
agree, up to float summation order. Deltas are averaged, not summed, so the step size is that
of one optimizer step (for plain SGD, averaging the deltas of local-mean gradients is exactly
the sync step; for adaptive optimizers, summing P steps would multiply the learning rate by P).
``staleness=0`` is sync mode itself (algorithms/sync.py).

Sufficient factor broadcasting does not apply (a delta after momentum or Adam is not the rank-K
product of the layer's factors); compression does (the deltas travel in fp16/bf16).
docs/ssp.md has the costs and measurements.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import time
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.algorithms.base import (Algorithm, AlgorithmContext, AlgorithmImpl,
                                         items_of, variable_names)
from tf_poseidon.algorithms.registry import register
from tf_poseidon.algorithms.sync import GRADIENTS, SyncImpl
from tf_poseidon.comm import buckets as buckets_lib, collectives, graph_ops
from tf_poseidon.comm.codecs import Codec, Exact
from tf_poseidon.comm.engine import CollectiveGroup, CommEngine
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult


PAIRWISE_TAG = 7200  # the two-rank exchange's messages on the engine's communicator
DELTAS = "ssp_deltas"
"""The collective group of a batch's parameter deltas."""
CHUNK_BYTES = 8 << 20
PIPELINE_DEPTH = 4
"""The engine sums a batch in chunks of CHUNK_BYTES, up to PIPELINE_DEPTH in flight (so that the
link never idles between chunks), into scratch chunks of its own, so that the correction
replaces the update in place: the only memory beyond the two buffers per bucket."""


@register
class SSP(Algorithm):
    """Stale synchronous parallel with staleness bound ``staleness`` (an int >= 0; 0 is sync
    mode itself): see the module docstring and docs/ssp.md."""

    name = "ssp"
    training_groups = (GRADIENTS, DELTAS)  # staleness 0 is sync itself

    def __init__(self, staleness: int = 0):
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"PoseidonStrategy: staleness={staleness!r} is not valid; it "
                             "must be an integer >= 0 (0 = synchronous).")
        self.staleness = staleness

    @property
    def lockstep(self) -> bool:
        return self.staleness == 0

    def options(self) -> dict:
        return {"staleness": self.staleness}

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        return SyncImpl(context) if self.staleness == 0 else SSPImpl(context, self.staleness)


def batch_steps(staleness: int) -> int:
    """m, the steps of one exchange: the largest with 2m − 1 <= staleness (at least 1)."""
    return max(1, (staleness + 1) // 2)


class _DeltaExchange(BucketProtocol):
    """The batched delta exchange of one set of variables, as the protocol of its buckets (kind
    "ssp_delta"): its engine group, the two buffers per bucket, and the steps each batch holds.

    Graph side, built by the methods a train step calls (``before_update``, ``after_update``;
    eagerly they run at once): at the first step after a rebase (creation, a drain) the base is
    taken before the update (``take_base``); at a batch's last step the group runs through
    ``graph_ops.run_buckets``: ``pack`` (the enqueue op) makes the base into d = W − base,
    ``receive`` (the collect op) waits for the previous batch's correction if there is one, and
    ``finish`` applies it (``apply``, in a tf.cond) and takes the next base (``next_base``).
    ``run`` is the engine's side; ``drain`` runs eagerly. A lock guards the bookkeeping shared
    with the engine thread.
    """

    kind = "ssp_delta"

    def __init__(self, group_name: str, codec: Codec, variables, plan_buckets,
                 staleness: int, num_replicas: int, stats: "SSPStats"):
        self.variables = list(variables)
        self.plan = plan_buckets(items_of(self.variables, variable_names(self.variables),
                                          self.kind))
        self.batch_steps = batch_steps(staleness)
        self.num_replicas = num_replicas
        self.stats = stats
        self.group = CollectiveGroup(group_name, self.plan, {self.kind: self})
        self._codec = codec
        # Two ranks, uncompressed: the peer's update comes by an exchange, which Open MPI
        # completes in one single-copy transfer, where its non-blocking all-reduce takes rounds
        # of polling and a summing pass (docs/ssp.md).
        self._pairwise = num_replicas == 2 and isinstance(self._codec, Exact)
        with tf.init_scope():  # plain eager variables, also when made while tracing
            self.position = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="ssp_batch_position")  # steps of the batch taken
            self.rebase = tf.Variable(True, trainable=False, name="ssp_rebase")
        # Each member on a 64-byte boundary of the buffers, so that its correction becomes a
        # tensor without a copy (TensorFlow copies an unaligned numpy_function output).
        self._slices = [buckets_lib.member_slices(b.sizes, b.payload_dtype) for b in self.plan]
        count = len(self.plan)
        self._base: list[np.ndarray | None] = [None] * count   # the current batch's base
        self._spare: list[list[np.ndarray]] = [[] for _ in range(count)]  # free buffers
        self._due: list[np.ndarray | None] = [None] * count    # a correction taken, not applied
        self._sent = [collections.deque() for _ in range(count)]  # (first step, steps) in flight
        self._steps = [0] * count    # steps handed to the engine
        self._applied = [0] * count  # steps applied
        self._scratch: dict[np.dtype, list[np.ndarray]] = {}  # the engine thread's
        self._drain_functions: dict = {}
        self._lock = threading.Lock()

    # -- graph side ----------------------------------------------------------------------

    def before_update(self) -> tf.Tensor:
        """Before the optimizer's update (the caller makes the update wait for the result):
        takes the base on the first step after a rebase; a scalar int64."""
        def take():
            done = graph_ops.numpy_outputs(self.take_base,
                                           [v.read_value() for v in self.variables],
                                           [tf.int64], f"tp_base_{self.group.name}")
            with tf.control_dependencies(done):
                self.rebase.assign(False)
            return tf.constant(0, tf.int64)
        return tf.cond(self.rebase, take, lambda: tf.constant(0, tf.int64))

    def after_update(self, engine: CommEngine, sequencer: graph_ops.Sequencer) -> None:
        """After the optimizer's update: counts the step and, at a batch's last one, runs the
        exchange (every rank takes the same branch: same step count)."""
        position = self.position.assign_add(1)

        def exchange():
            self._exchange(engine, sequencer)
            return tf.constant(0, tf.int64)
        tf.cond(tf.equal(position, self.batch_steps), exchange,
                lambda: tf.constant(0, tf.int64))

    def _exchange(self, engine: CommEngine, sequencer: graph_ops.Sequencer) -> None:
        graph_ops.run_buckets(engine, sequencer, self.group,
                              [[tf.identity(v)] for v in self.variables])
        self.position.assign(0)

    def take_base(self, *values: np.ndarray) -> np.int64:
        """TF thread: the variables' ``values`` (in variable order) become each bucket's base."""
        for bucket in self.plan:
            self._set_base(bucket, self._buffer(bucket), [values[i] for i in bucket.members])
        return np.int64(0)

    def stage(self, bucket: buckets_lib.Bucket, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        return [*tensors, self.position.read_value()]

    def pack(self, bucket: buckets_lib.Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The bucket's batch update d = W − base, in the base's buffer (``arrays``: the
        members' values after the update, then the steps in the batch)."""
        *values, steps = arrays
        index = bucket.index
        update, self._base[index] = self._base[index], None
        for value, part in zip(values, self._slices[bucket.index]):
            np.subtract(value.reshape(-1).astype(update.dtype, copy=False), update[part],
                        out=update[part])
        with self._lock:
            self._sent[index].append((self._steps[index], int(steps)))
            self._steps[index] += int(steps)
        return update

    def outputs(self, bucket: buckets_lib.Bucket) -> list[tuple[tf.DType, list]]:
        return [(tf.bool, [1])]

    def receive(self, group, bucket: buckets_lib.Bucket) -> list[np.ndarray]:
        """TF thread, in the collect op of a batch's last step t: if a batch was in flight
        before this one, waits for its correction (at most the collective timeout), takes it
        for ``apply`` and returns ``[True]``; else ``[False]``."""
        index = bucket.index
        with self._lock:
            due = len(self._sent[index]) > 1
        if due:
            self._take(index, now=self._steps[index] - 1)
        return [np.array([due])]

    def finish(self, bucket, outputs, inputs) -> list[None]:
        """Applies the correction taken, when there was one (a tf.cond)."""
        [due] = outputs

        def apply_then_rebase():
            with tf.control_dependencies(self.apply(bucket)):
                return self._rebase(bucket)
        tf.cond(due[0], apply_then_rebase, functools.partial(self._rebase, bucket))
        return [None] * len(bucket.members)

    def _rebase(self, bucket: buckets_lib.Bucket) -> tf.Tensor:
        [done] = graph_ops.numpy_outputs(
            functools.partial(self.next_base, bucket), [self.variables[i].read_value()
                                                        for i in bucket.members],
            [tf.int64], f"tp_next_base_{self.group.name}_{bucket.index}")
        return done

    def apply(self, bucket: buckets_lib.Bucket) -> list:
        """W += the correction taken, for ``bucket``'s members, in place (a variable of another
        dtype than the payload's, bfloat16, is summed in the payload's and rounded once);
        returns the update ops. Graph ops, or eagerly."""
        members = [self.variables[i] for i in bucket.members]
        pieces = graph_ops.numpy_outputs(
            functools.partial(self.correction, bucket.index), [],
            [tf.as_dtype(bucket.payload_dtype)] * len(members),
            f"tp_correction_{self.group.name}_{bucket.index}")
        updates = []
        for variable, piece in zip(members, pieces):
            piece = tf.reshape(piece, variable.shape)
            if piece.dtype == variable.dtype:
                updates.append(variable.assign_add(piece))
            else:
                updates.append(variable.assign(
                    tf.cast(tf.cast(variable, piece.dtype) + piece, variable.dtype)))
        return updates

    def correction(self, index: int) -> list[np.ndarray]:
        """Bucket ``index``'s correction taken, one piece per member (views of its buffer)."""
        due = self._due[index]
        return [due[part] for part in self._slices[index]]

    def next_base(self, bucket: buckets_lib.Bucket, *values: np.ndarray) -> np.int64:
        """TF thread, at a batch's last step after any correction is applied: the members' new
        ``values`` become the next batch's base, in the applied correction's buffer (else a
        spare one)."""
        base, self._due[bucket.index] = self._due[bucket.index], None
        self._set_base(bucket, self._buffer(bucket) if base is None else base, values)
        return np.int64(0)

    def _set_base(self, bucket: buckets_lib.Bucket, buffer: np.ndarray,
                  values: Sequence[np.ndarray]) -> None:
        """The members' ``values`` into ``buffer``, which becomes the bucket's base."""
        for value, part in zip(values, self._slices[bucket.index]):
            buffer[part] = value.reshape(-1)
        self._base[bucket.index] = buffer

    def _take(self, index: int, now: int) -> None:
        """Waits for the oldest batch in flight and keeps its correction for applying at step
        ``now``, recording how late each of its steps is."""
        with self._lock:
            first, steps = self._sent[index].popleft()
        start = time.perf_counter()
        self._due[index] = self.group.wait_result(index)
        self.stats.record_blocked(time.perf_counter() - start)
        self._applied[index] += steps
        if index == 0:
            for step in range(first, first + steps):
                self.stats.record_lateness(now - step)

    def _buffer(self, bucket: buckets_lib.Bucket) -> np.ndarray:
        spare = self._spare[bucket.index]
        if spare:
            return spare.pop()
        buffer = buckets_lib.aligned_empty(self._slices[bucket.index][-1].stop,
                                           bucket.payload_dtype)
        buffer[:] = 0  # the gaps between members stay zero: they travel, and sum to zero
        return buffer

    # -- engine side ---------------------------------------------------------------------

    def run(self, comm, call: BucketCall) -> BucketResult:
        """Engine thread: sums the payload d over ranks and replaces it by the correction
        (Σ_q d_q)/P − d, chunk by chunk, up to PIPELINE_DEPTH chunks in flight (one at a time
        for a codec's own sum). Nothing waits for it before the next batch's last step, so it
        waits without spinning a core."""
        update = call.payload
        comm = collectives.YieldingComm(comm)
        chunk = max(1, CHUNK_BYTES // update.itemsize)
        posted = self._pairwise or isinstance(self._codec, Exact)
        slots = self._slots(PIPELINE_DEPTH if posted else 1, min(chunk, update.size),
                            update.dtype)
        in_flight: collections.deque = collections.deque()
        for number, start in enumerate(range(0, update.size, chunk)):
            mine = update[start:start + chunk]
            theirs = slots[number % len(slots)][:mine.size]
            in_flight.append((mine, theirs, self._post(comm, mine, theirs) if posted else ()))
            if len(in_flight) == len(slots):
                self._correct(comm, *in_flight.popleft())
        while in_flight:
            self._correct(comm, *in_flight.popleft())
        return BucketResult(update, *self._codec.wire_bytes(update.size, comm.Get_size(),
                                                            update.dtype))

    def _post(self, comm, mine: np.ndarray, theirs: np.ndarray) -> tuple:
        """Starts a chunk's exchange (two ranks) or all-reduce into ``theirs``."""
        raw = comm.comm
        if self._pairwise:
            peer = 1 - raw.Get_rank()
            return (raw.Irecv(theirs, source=peer, tag=PAIRWISE_TAG),
                    raw.Isend(mine, dest=peer, tag=PAIRWISE_TAG))
        return (raw.Iallreduce(mine, theirs, op=collectives.mpi().SUM),)

    def _correct(self, comm, mine: np.ndarray, theirs: np.ndarray, requests: tuple) -> None:
        """Completes a chunk's sum (``requests``, or the codec's sum now) and writes its
        correction over ``mine``."""
        if requests:
            comm.wait(*requests)
        else:
            self._codec.sum_into(comm, mine, theirs)
        if self._pairwise:  # theirs is the peer's d: (d_peer − d)/2
            np.subtract(theirs, mine, out=mine)
            mine *= mine.dtype.type(0.5)
        else:  # (Σ_q d_q)/P − d
            theirs /= self.num_replicas
            np.subtract(theirs, mine, out=mine)

    def _slots(self, count: int, size: int, dtype: np.dtype) -> list[np.ndarray]:
        """``count`` scratch chunks of ``size`` elements, kept between calls (engine thread)."""
        slots = self._scratch.get(np.dtype(dtype), [])
        if len(slots) < count or slots[0].size < size:
            slots = self._scratch[np.dtype(dtype)] = [np.empty(size, dtype)
                                                      for _ in range(count)]
        return slots[:count]

    # -- the end of a fit ----------------------------------------------------------------

    def drain(self, engine: CommEngine, sequencer: graph_ops.Sequencer) -> None:
        """Every rank, eagerly: exchanges the steps since the last exchange (every rank has
        taken as many), applies every correction, and makes the next step take a new base."""
        if int(self.position.numpy()):
            self._traced("exchange", functools.partial(self._exchange, engine, sequencer))
        for bucket in self.plan:
            index = bucket.index
            if self._sent[index]:
                self._take(index, now=self._steps[index])
                self._traced(("apply", index), functools.partial(self.apply, bucket))
            self._spare[index] += [b for b in (self._due[index], self._base[index])
                                   if b is not None]  # kept for the next fit
            self._due[index] = self._base[index] = None
        self.rebase.assign(True)

    def _traced(self, key, build) -> None:
        """Runs the ops ``build()`` makes as a tf.function, made once per ``key``: an eager
        ``assign_add`` of a correction copies the variable's buffer (docs/ssp.md), a traced one
        adds in place."""
        function = self._drain_functions.get(key)
        if function is None:
            def ops() -> None:
                build()
            function = self._drain_functions[key] = tf.function(ops, autograph=False)
        function()



class SSPStats:
    """Observed staleness (bucket 0's remote updates, in steps late) and time blocked."""

    def __init__(self):
        self.lateness = collections.Counter()
        self.blocked_s = 0.0
        self._lock = threading.Lock()

    def record_lateness(self, steps: int) -> None:
        with self._lock:
            self.lateness[steps] += 1

    def record_blocked(self, seconds: float) -> None:
        with self._lock:
            self.blocked_s += seconds

    def report(self) -> dict:
        with self._lock:
            return {"staleness_histogram": {str(k): v for k, v in sorted(self.lateness.items())},
                    "blocked_on_bound_s": self.blocked_s}


class SSPImpl(AlgorithmImpl):
    """``SSP(staleness=s)`` with s >= 1 at runtime; see the module docstring."""

    def __init__(self, context: AlgorithmContext, staleness: int):
        super().__init__(context)
        if context.config.bucket_bytes is None:
            # The exchange starts after the update, so nothing overlaps backprop: small buckets
            # would only add op and MPI calls per step (docs/ssp.md). An explicit bucket_bytes
            # is kept.
            self.bucket_bytes = self.first_bucket_bytes = sys.maxsize
        self.staleness = staleness
        self._exchanges: dict[tuple, _DeltaExchange] = {}
        self.ssp_stats = SSPStats()

    def reduce_gradients(self, grads, variables, local_batch):
        """The optimizer applies this rank's local-mean gradient; no communication here. On the
        first step after a drain the update waits for the base to be taken. A rank with no
        examples in the step (a last batch shorter than P) applies a zero gradient."""
        taken = self._exchange_for(variables).before_update()
        with tf.control_dependencies([taken]):
            return [tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
                    if isinstance(g, tf.IndexedSlices) else tf.identity(g)
                    for g in self.local_mean(grads, local_batch)]

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        """Counts the step; at a batch's last step, exchanges the batch's updates and applies
        the previous batch's (see _DeltaExchange)."""
        self._exchange_for(variables).after_update(self.engine, self.sequencer)

    def _exchange_for(self, variables) -> _DeltaExchange:
        # One exchange per set of variables, kept across retraces (a short last batch retraces
        # the step): its batches in flight, base and staleness accounting continue.
        key = tuple((v.name, tuple(v.shape.as_list())) for v in variables)
        if key not in self._exchanges:
            self._exchanges[key] = _DeltaExchange(
                DELTAS, self.codec, variables, self.plan_buckets, self.staleness,
                self.num_replicas, self.ssp_stats)
        return self._exchanges[key]

    def drain(self) -> None:
        """Every rank, eagerly: exchanges and applies every pending update; afterwards the
        replicas agree."""
        for exchange in self._exchanges.values():
            exchange.drain(self.engine, self.sequencer)

    def stats(self) -> dict:
        return {**self.ssp_stats.report(), "batch_steps": batch_steps(self.staleness)}
