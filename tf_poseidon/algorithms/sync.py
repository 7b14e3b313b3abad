"""Bulk synchronous parallel (``mode="sync"``, the default): each step every rank applies Σ_p g_p.

With compression "none", P ranks at global batch B give the weights of one process at batch B,
up to float summation order. With a 16-bit codec the sum travels in 16 bits and is accumulated
in float32 (comm/codecs.py).

Per gradient, the protocol that carries it is the per-layer plan's choice (sacp/plan.py): Dense
kernels may travel as sufficient factors (``sfb="auto"|"always"``; sfb/), embeddings' sparse
gradients (``IndexedSlices``) as the rows each rank looked up (comm/sparse.py) when that is
fewer bytes, matrix-shaped gradients as low-rank approximations with error feedback
(``lowrank=tp.PowerSGD(...)``; lowrank/), every other gradient is all-reduced. While the
replica function is traced, Dense layers record their factors
(:meth:`SyncImpl.tracing_replica_function`); at the reduction all gradients — summed ones,
factors, sparse rows, low-rank ones — go into one group of buckets in backprop order
(graph_ops.run_buckets), and the kernels sent by SFB are rebuilt from every rank's factors.
Low-rank compression is approximate and keeps state between steps (each rank's residuals, the
shared Q): :meth:`SyncImpl.training_state` and :meth:`SyncImpl.restore_training_state` move it
to and from a backup.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.algorithms import batch_share
from tf_poseidon.algorithms.base import (Algorithm, AlgorithmContext, AlgorithmImpl,
                                         variable_names)
from tf_poseidon.algorithms.registry import register
from tf_poseidon.comm import autotune, buckets as buckets_lib, graph_ops, sparse
from tf_poseidon.comm.engine import CollectiveGroup
from tf_poseidon.lowrank import protocol as lowrank_protocol
from tf_poseidon.sacp import plan as plan_lib
from tf_poseidon.sfb import capture, protocol as sfb_protocol

GRADIENTS = "gradients"
"""The collective group of a training step's gradients."""


@register
class Sync(Algorithm):
    """Every rank applies the sum of all ranks' gradients each step (BSP); no knobs."""

    name = "sync"
    plans = True
    training_groups = (GRADIENTS,)

    def reify(self, context: AlgorithmContext) -> "SyncImpl":
        return SyncImpl(context)


class SyncImpl(AlgorithmImpl):
    """Sums the gradients of all ranks through the engine, in buckets (comm/buckets.py)."""

    def __init__(self, context: AlgorithmContext):
        super().__init__(context)
        self._overlap = context.config.overlap
        self._sessions: list[capture.CaptureSession] = []  # traced replica functions
        self._planner = plan_lib.Planner(self.engine, context.config, self.num_replicas)
        self._protocols = {self.summing.kind: self.summing,
                           sfb_protocol.KIND: sfb_protocol.SfbProtocol(self.codec),
                           sparse.KIND: sparse.SparseProtocol(self.codec)}
        self._tuner = (autotune.GradientTuner(self.codec, tune_overlap=self._overlap)
                       if context.config.autotune else None)
        self._lowrank = None
        if context.config.lowrank is not None:
            self._lowrank = lowrank_protocol.LowRankProtocol(context.config.lowrank, self.codec)
            self._protocols[lowrank_protocol.KIND] = self._lowrank

    def tracing_replica_function(self):
        """Captures Dense layers' factors while the replica function is traced (unless
        sfb="never"). Called by the strategy on the tracing thread; never blocks."""
        if self.config.sfb == "never":
            return contextlib.nullcontext()
        return self._capturing()

    @contextlib.contextmanager
    def _capturing(self):
        session = capture.CaptureSession()
        self._sessions.append(session)
        try:
            with capture.capturing(session):
                yield
        finally:
            self._sessions.remove(session)

    def plan(self) -> plan_lib.Plan | None:
        return self._planner.plan

    def stats(self) -> dict:
        """With ``autotune``: ``autotune``, per bucket layout tuned, the trials' state, the
        candidates with their median step time and the choice (comm/autotune.py). With
        low-rank compression: ``lowrank_compute_s``, this rank's seconds of low-rank compute
        (matrix products, orthonormalization, residual passes; not the rounds) in each of the
        recent steps, oldest first."""
        report = {}
        if self._tuner is not None:
            report["autotune"] = self._tuner.report()
        if self._lowrank is not None:
            seconds = self._lowrank.compute_seconds()
            report["lowrank_compute_s"] = [seconds[key] for key in sorted(seconds)]
        return report

    def training_state(self) -> dict[str, np.ndarray]:
        """Every rank, blocking and collective: the low-rank state (``lowrank/<variable>/q``,
        ``.../steps`` and ``.../residual``, the residuals summed over ranks, complete on rank 0
        only); empty without low-rank compression."""
        if self._lowrank is None:
            return {}
        arrays = self.engine.call(self._lowrank.state_arrays, label="low-rank state")
        return {f"{LOWRANK_STATE}{key}": value for key, value in arrays.items()}

    def restore_training_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Any rank, not collective: takes what :meth:`training_state` saved (on any number of
        ranks: each rank gets 1/P of the summed residuals). Entries of low-rank state are
        ignored without low-rank compression (its residuals are then lost)."""
        if self._lowrank is None:
            return
        self._lowrank.restore({key[len(LOWRANK_STATE):]: value for key, value in arrays.items()
                               if key.startswith(LOWRANK_STATE)}, self.num_replicas)

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        """Returns Σ_p g_p for each gradient (same shapes and dtypes; an ``IndexedSlices``
        gradient sent as sparse rows comes back as the IndexedSlices of every rank's rows, in
        rank order); replica context.

        With ``local_batch`` (this rank's example count in the step), each rank's gradient is
        weighted by its share of the global batch (batch_share.py). Where the replica context
        says the optimizer applies sparse rows one by one (``optimizer_applies_rows``, set by
        the Keras optimizer integration), embedding gradients always travel as sparse rows.
        Blocking: in a graph, the returned tensors' ops block until the sums are there;
        eagerly, the call blocks. The first trace with a gradient another protocol could carry
        (a captured Dense kernel, an embedding's IndexedSlices, a matrix with ``lowrank=``)
        agrees the per-layer plan with the other ranks (a collective, blocking until every
        rank reaches it). Gradients sent low-rank come back as their low-rank sums
        (approximate; tf_poseidon/lowrank/).
        """
        session = self._sessions[-1] if self._sessions else None
        context = tf.distribute.get_replica_context()
        choices = self._planner.choose(session, grads, variables,
                                       getattr(context, "optimizer_applies_rows", False))
        names = variable_names(variables)
        weight = (batch_share.Weighting(local_batch, self.num_replicas)
                  if local_batch is not None else None)
        items, inputs = [], []
        ones, lowrank_names = None, set()
        for grad, variable, name, (match, row) in zip(grads, variables, names, choices):
            if isinstance(grad, tf.IndexedSlices):
                if row is not None and row.choice == plan_lib.SPARSE:
                    rows, width = row.shape
                    items.append(sparse.item(name, rows, width, row.local_batch))
                    indices, values = sparse.inputs_of(grad, width)
                    inputs.append([indices, values if weight is None else weight.apply(values)])
                    continue
                grad = tf.convert_to_tensor(grad)  # the plan's choice: the dense all-reduce
            if row is not None and row.choice == plan_lib.LOWRANK:
                value = _with_static_shape(grad, variable)
                # The item's name keys the member's state: unique, as variables' paths are.
                key = name if name not in lowrank_names else f"{name}#{len(lowrank_names)}"
                lowrank_names.add(key)
                items.append(lowrank_protocol.item(key, variable.shape.as_list()))
                if weight is None:
                    ones = tf.ones([1], tf.float32) if ones is None else ones
                inputs.append([value, ones] if weight is None
                              else [weight.apply(value), weight.count])
                continue
            if row is not None and row.choice == plan_lib.SFB:
                factors = match.factors
                if factors is None:
                    raise RuntimeError(f"tf_poseidon SFB: the plan sends {name} by SFB but "
                                       "this rank captured no factors for it.")
                items.append(sfb_protocol.item(name, match.m, match.n, row.local_batch))
                # Weighting V by n_p weights the rebuilt gradient as batch_share weights g.
                inputs.append([factors.u, factors.v if weight is None
                               else weight.apply(factors.v)])
            else:
                value = _with_static_shape(grad, variable)
                items.append(buckets_lib.Item.of(value, name))
                inputs.append([value if weight is None else weight.apply(value)])
        if weight is not None:
            items.append(buckets_lib.Item.of(weight.count, "batch_share"))
            inputs.append([weight.count])
        wait_for = [t for member in inputs for t in member] if not self._overlap else []
        group = CollectiveGroup(GRADIENTS, self.plan_buckets(items), self._protocols,
                                self._tuner)
        results = graph_ops.run_buckets(self.engine, self.sequencer, group, inputs, wait_for)
        factor = weight.unweighting(results.pop()) if weight is not None else None
        reduced = []
        for grad, (match, row), result in zip(grads, choices, results):
            if isinstance(result, tf.IndexedSlices):
                values = result.values if factor is None else result.values * factor
                reduced.append(tf.IndexedSlices(tf.cast(values, grad.dtype), result.indices,
                                                result.dense_shape))
                continue
            if not isinstance(result, sfb_protocol.GatheredFactors):
                reduced.append(result if factor is None
                               else result * tf.cast(factor, result.dtype))
                continue
            value = sfb_protocol.reconstruct(result, grad.shape, grad.dtype,
                                             1.0 if factor is None else factor)
            if match.extra:
                # Parts equal on every rank (a regularizer's gradient): the sum over ranks
                # of each rank's (batch-share weighted) copy is exactly P times it.
                value += tf.cast(self.num_replicas, grad.dtype) * tf.add_n(match.extra)
            reduced.append(value)
        return reduced


LOWRANK_STATE = "lowrank/"
"""The prefix of the low-rank entries in :meth:`SyncImpl.training_state`."""


def _with_static_shape(grad: tf.Tensor, variable: tf.Variable) -> tf.Tensor:
    """``grad`` with its variable's static shape where TensorFlow lost it (the kernel gradient
    of a Dense layer on 3-D input with a dynamic batch arrives as [None, N])."""
    if not grad.shape.is_fully_defined() and variable.shape.is_fully_defined():
        return tf.reshape(grad, variable.shape)
    return grad
