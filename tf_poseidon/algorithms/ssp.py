"""Stale synchronous parallel (mode="ssp", staleness=s): bounded-staleness delta exchange.

Ho et al.'s SSP, realised with collectives instead of a parameter server. What travels is each
rank's *parameter update* (the delta its optimizer made from its own, local-mean gradient),
averaged over ranks: the weights every rank converges to are

    W = W_0 + Σ_t (1/P) Σ_p Δ_p(t).

At step t, rank p

1. lets its optimizer update the variables from its local gradient (so its optimizer state —
   momentum, Adam moments — follows its own gradients, as a worker's does in SSP), and keeps
   that update Δ_p(t) in full for now (an SSP worker reads its own writes);
2. posts the all-reduce of Δ_p(t)/P without waiting;
3. if step t−s's all-reduce is not applied yet, *waits* for it and applies it with every later
   one already completed, each as R(τ) − Δ_p(τ): the average less the own update it holds (so
   the others' updates of step t are applied no later than its step t+s, and a rank more than
   s steps ahead of the slowest blocks). Like an SSP worker's cache, refreshed only when too
   stale, late updates come in batches of about s steps: one pass over the parameters each.

Every update is applied exactly once on every rank, so after a drain (all pending all-reduces
completed and applied: end of ``fit``, before ``evaluate``/``predict``/saving, and
``strategy.drain()``) the replicas agree, up to float summation order. Deltas are averaged,
not summed, so the step size is that of one optimizer step (for plain SGD, averaging the deltas
of local-mean gradients is exactly the sync step; for adaptive optimizers, summing P steps
would multiply the learning rate by P). ``staleness=0`` is sync mode itself (algorithms/sync.py).

Sufficient factor broadcasting does not apply (a delta after momentum or Adam is not the rank-K
product of the layer's factors); compression does (the deltas travel in fp16/bf16).
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

from tf_poseidon import host_kernels
from tf_poseidon.algorithms.base import (Algorithm, AlgorithmContext, AlgorithmImpl,
                                         items_of, variable_names)
from tf_poseidon.algorithms.registry import register
from tf_poseidon.algorithms.sync import GRADIENTS, SyncImpl
from tf_poseidon.comm import buckets as buckets_lib, collectives, graph_ops
from tf_poseidon.comm.codecs import Codec, Exact
from tf_poseidon.comm.engine import CollectiveGroup
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult


PAIRWISE_TAG = 7200  # the two-rank exchange's messages on the engine's communicator
DELTAS = "ssp_deltas"
"""The collective group of a training step's parameter deltas."""


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


class _DeltaExchange(BucketProtocol):
    """The stale all-reduce of one set of variables, as the protocol of its buckets (kind
    "ssp_delta"): its engine group, this rank's own shares still in flight, and how far each
    bucket's results have been applied.

    Per step and bucket, on TF's threads: ``pack`` (in the enqueue op) forms this rank's
    share Δ/P from the variables after and before the update; ``refresh`` (the collect) decides
    whether step t must apply late updates — only when step t−s's are not applied yet — and if
    so waits for those and takes every other step's already completed too; ``refreshed_values``
    then returns the variables' new values

        W + Σ_τ (R(τ) − P·Δ_p(τ)/P)     over the steps τ taken,

    with R(τ) the all-reduced shares: what turns the own update, applied in full by the
    optimizer, into everyone's average. (At two ranks without compression R(τ) is the peer's
    share alone, and the own share counts once: W + Σ_τ (R(τ) − Δ_p(τ)/P).) Applying late
    updates in batches of about s steps, as an SSP worker refreshes its cache only when it is
    too stale, makes one pass over the parameters per batch instead of one per step, and the
    new values are assigned, not added (TensorFlow adopts the aligned arrays as the variables'
    buffers). Each step's share stays in place while in flight (the result is written into a
    separate buffer), and both go back to a pool once applied. ``drain`` runs eagerly; a lock
    guards the bookkeeping.
    """

    kind = "ssp_delta"

    def __init__(self, group_name: str, codec: Codec, variables, plan_buckets,
                 staleness: int, num_replicas: int, stats: "SSPStats"):
        self.variables = list(variables)
        self.plan = plan_buckets(items_of(self.variables, variable_names(self.variables),
                                          self.kind))
        self.staleness = staleness
        self.num_replicas = num_replicas
        self.stats = stats
        self.group = CollectiveGroup(group_name, self.plan, {self.kind: self})
        self._codec = codec
        # Two ranks, uncompressed: the result is the peer's share alone (an exchange, which
        # Open MPI completes in one single-copy transfer, where its non-blocking all-reduce
        # takes rounds of polling and a summing pass), and each own share is subtracted once.
        self._pairwise = num_replicas == 2 and isinstance(self._codec, Exact)
        self._own_scale = 1 if self._pairwise else num_replicas
        count = len(self.plan)
        self._own = [collections.deque() for _ in range(count)]  # own shares in flight
        self._steps = [0] * count                    # refresh() calls = current step
        self._applied = [0] * count                  # instances applied
        self._due: list[list] = [[] for _ in range(count)]  # (result, own) taken, not applied
        self._pool: dict[tuple[int, np.dtype], list[np.ndarray]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def _buffer(self, size: int, dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._pool[size, dtype]
            return free.pop() if free else buckets_lib.aligned_empty(size, dtype)

    def _release(self, *buffers: np.ndarray) -> None:
        with self._lock:
            for buffer in buffers:
                self._pool[buffer.size, buffer.dtype].append(buffer)

    def run(self, comm, call: BucketCall) -> BucketResult:
        """Engine thread: the result goes to a buffer of its own; the share stays for
        refreshed_values. Nothing waits for it before step t+s, so it waits without spinning
        a core."""
        share = call.payload
        comm, out = collectives.YieldingComm(comm), self._buffer(share.size, share.dtype)
        sent = self._codec.wire_bytes(share.size, comm.Get_size(), share.dtype)
        if self._pairwise:
            peer = 1 - comm.Get_rank()
            comm.Sendrecv(share, dest=peer, recvbuf=out, source=peer, tag=PAIRWISE_TAG)
        else:
            self._codec.sum_into(comm, share, out)
        return BucketResult(out, *sent)

    def pack(self, bucket: buckets_lib.Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The bucket's Δ/P from its members' values after and before the update (``arrays``:
        after, before of each member in turn)."""
        own = self._buffer(bucket.num_elements, bucket.payload_dtype)
        for after, before, part in zip(arrays[::2], arrays[1::2],
                                       buckets_lib.member_slices(bucket.sizes)):
            host_kernels.scaled_difference(after, before, own[part], 1.0 / self.num_replicas)
        with self._lock:
            self._own[bucket.index].append(own)
        return own

    def outputs(self, bucket: buckets_lib.Bucket) -> list[tuple[tf.DType, list]]:
        return [(tf.bool, [1])]

    def receive(self, group, bucket: buckets_lib.Bucket) -> list[np.ndarray]:
        return [self.refresh(bucket.index)]

    def finish(self, bucket, outputs, inputs) -> list[None]:
        """Assigns the refreshed values when late updates were due (a tf.cond)."""
        [due] = outputs
        tf.cond(due[0], functools.partial(assign_refreshed, self, bucket, self.variables),
                lambda: None)
        return [None] * len(bucket.members)

    def _take(self, index: int, result: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Matches the next ``result`` with its own share, recording how late it is applied."""
        with self._lock:
            own = self._own[index].popleft()
            instance = self._applied[index]
            self._applied[index] += 1
        if index == 0:
            self.stats.record_lateness(step - instance)
        return result, own

    def refresh(self, index: int) -> np.ndarray:
        """TF thread, in bucket ``index``'s collect op at step t: if step t−s's late updates
        are not applied yet, waits for them (at most the collective timeout each), takes those
        of every later step already completed (for ``refreshed_values``) and returns
        ``[True]``; else ``[False]``."""
        with self._lock:
            step = self._steps[index]
            self._steps[index] += 1
        if self._applied[index] > step - self.staleness:
            return np.array([False])
        while self._applied[index] <= step - self.staleness:
            start = time.perf_counter()
            result = self.group.wait_result(index)
            self.stats.record_blocked(time.perf_counter() - start)
            self._due[index].append(self._take(index, result, step))
        while self._applied[index] <= step:
            result = self.group.poll_result(index)
            if result is None:
                break
            self._due[index].append(self._take(index, result, step))
        return np.array([True])

    def refreshed_values(self, index: int, *values: np.ndarray) -> list[np.ndarray]:
        """Bucket ``index``'s members' ``values`` plus the late updates ``refresh`` took, as new
        aligned arrays of the values' dtypes; the taken buffers go back to the pool."""
        due, self._due[index] = self._due[index], []
        results, owns = zip(*due)
        refreshed = []
        for value, part in zip(values, buckets_lib.member_slices(self.plan[index].sizes)):
            out = buckets_lib.aligned_empty(value.size, value.dtype)
            host_kernels.sum_of_differences([r[part] for r in results], [o[part] for o in owns],
                                            self._own_scale, out, value.reshape(-1))
            refreshed.append(out)
        self._release(*results, *owns)
        return refreshed

    def drain(self) -> None:
        """Eagerly: waits for every pending instance and adds its late updates."""
        for bucket in self.plan:
            index = bucket.index
            self._due[index] += [self._take(index, self.group.wait_result(index),
                                            self._steps[index])
                                 for _ in range(len(self._own[index]))]
            if self._due[index]:
                assign_refreshed(self, bucket, self.variables)


def assign_refreshed(exchange: _DeltaExchange, bucket, variables) -> None:
    """Assigns ``exchange.refreshed_values`` to bucket's members (a graph op, or eagerly)."""
    members = [variables[i] for i in bucket.members]
    values = graph_ops.numpy_outputs(
        functools.partial(exchange.refreshed_values, bucket.index),
        [tf.identity(v) for v in members], [tf.as_dtype(v.dtype) for v in members],
        f"tp_refreshed_{exchange.group.name}_{bucket.index}")
    for variable, value in zip(members, values):
        variable.assign(tf.reshape(value, variable.shape))


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
        self._before: list[tf.Tensor] | None = None
        self.ssp_stats = SSPStats()

    def reduce_gradients(self, grads, variables, local_batch):
        """The optimizer applies this rank's local-mean gradient; no communication here.

        Also reads the variables' values before the update (the delta's origin). A rank with
        no examples in the step (a last batch shorter than P) applies a zero gradient.
        """
        self._before = [tf.identity(v) for v in variables]
        return self.local_mean(grads, local_batch)

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        """Posts the all-reduce of this rank's Δ/P; when step t−s's late updates are due,
        applies them (see _DeltaExchange)."""
        before, self._before = self._before, None
        if before is None or len(before) != len(variables):
            raise RuntimeError("tf_poseidon SSP: the optimizer update was not preceded by "
                               "this step's gradient reduction (a custom optimizer path?).")
        exchange = self._exchange_for(variables)
        inputs = [[tf.identity(v), b] for v, b in zip(variables, before)]
        graph_ops.run_buckets(self.engine, self.sequencer, exchange.group, inputs)

    def _exchange_for(self, variables) -> _DeltaExchange:
        # One exchange per set of variables, kept across retraces (a short last batch retraces
        # the step): its instances, in-flight contributions and staleness accounting continue.
        key = tuple((v.name, tuple(v.shape.as_list())) for v in variables)
        if key not in self._exchanges:
            self._exchanges[key] = _DeltaExchange(
                DELTAS, self.codec, variables, self.plan_buckets, self.staleness,
                self.num_replicas, self.ssp_stats)
        return self._exchanges[key]

    def drain(self) -> None:
        """Every rank, eagerly: applies every pending delta; afterwards replicas agree."""
        for exchange in self._exchanges.values():
            exchange.drain()

    def stats(self) -> dict:
        return self.ssp_stats.report()
