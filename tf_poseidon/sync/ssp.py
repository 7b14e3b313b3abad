"""Stale synchronous parallel (mode="ssp", staleness=s): bounded-staleness delta exchange.

Ho et al.'s SSP, realised with collectives instead of a parameter server. What travels is each
rank's *parameter update* (the delta its optimizer made from its own, local-mean gradient),
averaged over ranks: the weights every rank converges to are

    W = W_0 + Σ_t (1/P) Σ_p Δ_p(t).

At step t, rank p

1. lets its optimizer update the variables from its local gradient (so its optimizer state —
   momentum, Adam moments — follows its own gradients, as a worker's does in SSP);
2. applies its own share Δ_p(t)/P at once, and posts the all-reduce of Δ_p(t)/P without waiting;
3. applies the other ranks' shares of every earlier step whose all-reduce has completed, and
   *waits* for step t−s's (so the others' updates of step t are applied no later than its step
   t+s, and a rank more than s steps ahead of the slowest blocks).

Every update is applied exactly once on every rank, so after a drain (all pending all-reduces
completed and applied: end of ``fit``, before ``evaluate``/``predict``/saving, and
``strategy.drain()``) the replicas agree, up to float summation order. Deltas are averaged,
not summed, so the step size is that of one optimizer step (for plain SGD, averaging the deltas
of local-mean gradients is exactly the sync step; for adaptive optimizers, summing P steps
would multiply the learning rate by P). ``staleness=0`` is sync mode itself: BSPSynchronizer.

Sufficient factor broadcasting does not apply (a delta after momentum or Adam is not the rank-K
product of the layer's factors); compression does (the deltas travel in fp16/bf16).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import engine as engine_lib, graph_ops
from tf_poseidon.sync.base import Synchronizer, variable_names
from tf_poseidon.sync.bsp import BSPSynchronizer


def ssp_synchronizer(engine, sequencer, config, num_replicas) -> Synchronizer:
    """mode="ssp": SSPSynchronizer, or sync mode itself when staleness is 0."""
    cls = BSPSynchronizer if config.staleness == 0 else SSPSynchronizer
    return cls(engine, sequencer, config, num_replicas)


class _DeltaExchange:
    """The stale all-reduce of one set of variables: its engine group, this rank's own
    contributions still in flight, and how far each bucket's results have been applied.

    ``keep`` runs on TF's threads when a bucket is handed over, ``late`` when the step needs
    the stale results, ``drain`` eagerly; a lock guards the bookkeeping.
    """

    def __init__(self, group: engine_lib.CollectiveGroup, plan, variables, staleness: int,
                 stats: "SSPStats"):
        self.group = group
        self.plan = plan
        self.variables = list(variables)
        self.staleness = staleness
        self.stats = stats
        self._own = [collections.deque() for _ in plan]   # own payloads not yet matched
        self._steps = [0] * len(plan)                     # late() calls = current step
        self._applied = [0] * len(plan)                   # instances applied
        self._lock = threading.Lock()

    def keep(self, index: int, own: np.ndarray) -> None:
        with self._lock:
            self._own[index].append(own)

    def _apply_next(self, index: int, result: np.ndarray, into: np.ndarray, step: int) -> None:
        with self._lock:
            own = self._own[index].popleft()
            instance = self._applied[index]
            self._applied[index] += 1
        into += result - own  # the other ranks' shares
        if index == 0:
            self.stats.record_lateness(step - instance)

    def late(self, index: int) -> np.ndarray:
        """The other ranks' shares of every step newly completed, waiting for step t−s."""
        with self._lock:
            step = self._steps[index]
            self._steps[index] += 1
        late = np.zeros(self.plan[index].num_elements, self.plan[index].payload_dtype)
        while self._applied[index] <= step - self.staleness:
            start = time.perf_counter()
            result = self.group.wait_result(index)
            self.stats.record_blocked(time.perf_counter() - start)
            self._apply_next(index, result, late, step)
        while self._applied[index] <= step:
            result = self.group.poll_result(index)
            if result is None:
                break
            self._apply_next(index, result, late, step)
        return late

    def drain(self) -> None:
        """Eagerly: waits for every pending instance and adds its late shares to the variables."""
        for bucket in self.plan:
            late = np.zeros(bucket.num_elements, bucket.payload_dtype)
            while self._own[bucket.index]:
                self._apply_next(bucket.index, self.group.wait_result(bucket.index), late,
                                 self._steps[bucket.index])
            offset = 0
            for position, size in zip(bucket.members, bucket.sizes):
                variable = self.variables[position]
                piece = late[offset:offset + size].reshape(variable.shape.as_list())
                variable.assign_add(tf.cast(piece, variable.dtype))
                offset += size


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


class SSPSynchronizer(Synchronizer):
    """mode="ssp" with staleness s ≥ 1; see the module docstring."""

    lockstep = False

    def __init__(self, engine, sequencer, config, num_replicas):
        super().__init__(engine, sequencer, config, num_replicas)
        self.staleness = config.staleness
        self._exchanges: dict[tuple, _DeltaExchange] = {}
        self._before: list[tf.Tensor] | None = None
        self.ssp_stats = SSPStats()

    def reduce_gradients(self, grads, variables, local_batch):
        """The optimizer applies this rank's local-mean gradient; no communication here.

        Also reads the variables' values before the update (the delta's origin). A rank with
        no examples in the step (a last batch shorter than P) applies a zero gradient.
        """
        self._before = [tf.identity(v) for v in variables]
        grads = self.local_mean(grads)
        if local_batch is not None:
            grads = [tf.where(local_batch > 0, g, tf.zeros_like(g)) for g in grads]
        return grads

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        """Keeps Δ/P of this rank's update, posts its all-reduce, applies the stale shares."""
        before, self._before = self._before, None
        if before is None or len(before) != len(variables):
            raise RuntimeError("tf_poseidon SSP: the optimizer update was not preceded by "
                               "this step's gradient reduction (a custom optimizer path?).")
        shares = [(tf.identity(v) - b) / tf.cast(self.num_replicas, v.dtype)
                  for v, b in zip(variables, before)]
        exchange = self._exchange_for(variables, shares)
        late = graph_ops.bucketed_collective(
            self.engine, "ssp_deltas", shares, exchange.plan, self.summing, self.sequencer,
            variable_names(variables), group=exchange.group, keep=exchange.keep,
            wait=exchange.late)
        for variable, origin, share, others in zip(variables, before, shares, late):
            variable.assign(origin + share + others)

    def _exchange_for(self, variables, shares) -> _DeltaExchange:
        # One exchange per set of variables, kept across retraces (a short last batch retraces
        # the step): its instances, in-flight contributions and staleness accounting continue.
        key = tuple((v.name, tuple(v.shape.as_list())) for v in variables)
        if key not in self._exchanges:
            plan = self.plan_buckets(shares)
            names = variable_names(variables)
            layers = [[(names[i], n * b.payload_dtype.itemsize)
                       for i, n in zip(b.members, b.sizes)] for b in plan]
            group = engine_lib.CollectiveGroup("ssp_deltas", self.summing, layers)
            self._exchanges[key] = _DeltaExchange(group, plan, variables, self.staleness,
                                                  self.ssp_stats)
        return self._exchanges[key]

    def drain(self) -> None:
        """Every rank, eagerly: applies every pending delta; afterwards replicas agree."""
        for exchange in self._exchanges.values():
            exchange.drain()

    def stats(self) -> dict:
        return self.ssp_stats.report()
