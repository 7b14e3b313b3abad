"""Bulk synchronous parallel (mode="sync"): every step, every rank applies Σ_p g_p.

With compression="none", P ranks at global batch B give the weights of one process at batch B,
up to float summation order. With "fp16"/"bf16" the sum travels in 16 bits and is accumulated
in float32 (comm/codecs.py).

Dense kernels may travel as sufficient factors instead (``sfb="auto"|"always"``; tf_poseidon/
sacp/): while the replica function is traced, Dense layers record their factors (x, δ)
(:meth:`tracing_replica_function`); at the reduction, the plan agreed by every rank
(sacp/plan.py) says which kernel gradients are rebuilt from every rank's factors
(comm/sfb.py) and which are all-reduced. The factors go into the same bucket stream as the
other gradients, in backprop order. When the plan sends no kernel by SFB, the reduction is the
plain bucketed all-reduce, as with ``sfb="never"``.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import tensorflow as tf

from tf_poseidon.comm import graph_ops
from tf_poseidon.comm import sfb as sfb_comm
from tf_poseidon.sacp import capture
from tf_poseidon.sacp import plan as plan_lib
from tf_poseidon.sync import batch_share
from tf_poseidon.sync.base import Synchronizer, variable_names


class BSPSynchronizer(Synchronizer):
    """Sums the gradients of all ranks through the engine, in buckets (see comm/buckets.py)."""

    def __init__(self, engine, sequencer, config, num_replicas):
        super().__init__(engine, sequencer, config, num_replicas)
        self._overlap = config.overlap
        # SFB state: capture sessions of the replica functions being traced (innermost last),
        # the choices every rank agreed on ((kernel path, M, N) -> LayerPlan), the last plan.
        self._sessions: list[capture.CaptureSession] = []
        self._agreed: dict[tuple, plan_lib.LayerPlan] = {}
        self._rates = plan_lib.RatesCache()
        self.sfb_plan: plan_lib.Plan | None = None

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

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        """Returns Σ_p g_p for each gradient (same shapes and dtypes); called in a replica context.

        With ``local_batch`` (this rank's example count in the step), each rank's gradient is
        weighted by its share of the global batch (see batch_share.py). Blocking: in a graph,
        the returned tensors' ops block until the sums are there; eagerly, the call blocks.
        The first trace that captured Dense layers agrees the SFB plan with the other ranks
        (a collective, blocking until every rank reaches it; sacp/plan.py).
        """
        matches, rows = self._sfb_choices(grads, variables)
        if not any(row is not None and row.choice == plan_lib.SFB for row in rows):
            return self._allreduce(grads, variables, local_batch)
        return self._reduce_with_sfb(grads, variables, local_batch, matches, rows)

    def _allreduce(self, grads, variables, local_batch) -> list[tf.Tensor]:
        values, names = _with_static_shapes(grads, variables), variable_names(variables)
        if local_batch is not None:
            values = batch_share.weight_by_share(values, local_batch)
            names.append("batch_share")
        plan = self.plan_buckets(values)
        wait_for = list(values) if not self._overlap else []
        summed = graph_ops.bucketed_collective(self.engine, "gradients", values, plan,
                                               self.summing, self.sequencer,
                                               names, wait_for)
        if local_batch is not None:
            summed = batch_share.unweight_sum(summed, self.num_replicas)
        return summed

    # -- SFB ----------------------------------------------------------------------------

    def _sfb_choices(self, grads, variables):
        """Per gradient: its capture Match (or None) and its agreed LayerPlan (or None)."""
        session = self._sessions[-1] if self._sessions else None
        if session is None:
            return [None] * len(grads), [None] * len(grads)
        matches = [session.match(g, variables) for g in grads]
        candidates = [plan_lib.Candidate(m.kernel_name, m.m, m.n, m.rows, m.reason)
                      for m in matches if m is not None]
        seen = {c.kernel for c in candidates}
        skipped = [plan_lib.Candidate(name, *(shape or (None, None)), None, reason)
                   for name, (shape, reason) in session.skipped.items() if name not in seen]
        if any(c.refusal is None and (c.kernel, c.m, c.n) not in self._agreed
               for c in candidates):
            plan = plan_lib.agree(self.engine, candidates + skipped, self.config,
                                  self.num_replicas, self._rates)
            self._agreed.update({(row.kernel, *(row.shape or (None, None))): row
                                 for row in plan.rows})
            self.sfb_plan = plan
        elif candidates or skipped:
            if self.sfb_plan is None:  # nothing SFB could take: a local plan, no collective
                rows = [plan_lib.local_row(c, self.num_replicas, self.config.compression)
                        for c in candidates + skipped]
                self.sfb_plan = plan_lib.Plan(rows, self.num_replicas, self.config.sfb,
                                              self.config.compression, self._rates.rates)
        rows = [self._agreed.get((m.kernel_name, m.m, m.n))
                if m is not None and m.reason is None else None for m in matches]
        return matches, rows

    def _reduce_with_sfb(self, grads, variables, local_batch, matches, rows):
        names = variable_names(variables)
        chosen = [row is not None and row.choice == plan_lib.SFB for row in rows]
        if local_batch is not None:
            n_p = tf.cast(local_batch, tf.float32)
            has_data = n_p > 0
        items: list = []
        for grad, variable, name, match, row, sfb in zip(grads, variables, names, matches,
                                                         rows, chosen):
            if sfb:
                factors = match.factors
                if factors is None:
                    raise RuntimeError(f"tf_poseidon SFB: the plan sends {name} by SFB but "
                                       "this rank captured no factors for it.")
                v = factors.dy
                if local_batch is not None:  # weight V by n_p, as batch_share weights g
                    v = tf.where(has_data, v * tf.cast(n_p, v.dtype), tf.zeros_like(v))
                items.append(sfb_comm.FactorItem(name, factors.x, v, match.m, match.n,
                                                 row.local_batch))
            else:
                items.append(_with_static_shapes([grad], [variable])[0])
        if local_batch is not None:
            items = [it if sfb else tf.where(has_data, it * tf.cast(n_p, it.dtype),
                                             tf.zeros_like(it))
                     for it, sfb in zip(items, chosen)] + [tf.reshape(n_p, [1])]
            names.append("batch_share")
        wait_for = []
        if not self._overlap:
            for it in items:
                wait_for += [it.u, it.v] if isinstance(it, sfb_comm.FactorItem) else [it]
        results = sfb_comm.reduce_mixed(self.engine, "gradients", items, self.summing,
                                        self.config.compression, self.sequencer,
                                        self.bucket_bytes, self.first_bucket_bytes, names,
                                        wait_for)
        factor = None
        if local_batch is not None:
            factor = self.num_replicas / results.pop()[0]  # P / Σ_p n_p
        reduced = []
        for grad, match, result, sfb in zip(grads, matches, results, chosen):
            if not sfb:
                reduced.append(result if factor is None else result * tf.cast(factor,
                                                                               result.dtype))
                continue
            value = sfb_comm.reconstruct(result, grad.shape, grad.dtype,
                                         1.0 if factor is None else factor)
            if match.extra:
                # Parts equal on every rank (a regularizer's gradient): the sum over ranks
                # of each rank's (batch-share weighted) copy is exactly P times it.
                value += tf.cast(self.num_replicas, grad.dtype) * tf.add_n(match.extra)
            reduced.append(value)
        return reduced


def _with_static_shapes(grads, variables) -> list[tf.Tensor]:
    """``grads`` with their variables' static shapes where TensorFlow lost them (the kernel
    gradient of a Dense layer on 3-D input with a dynamic batch arrives as [None, N])."""
    return [tf.reshape(g, v.shape) if not g.shape.is_fully_defined()
            and v.shape.is_fully_defined() else g for g, v in zip(grads, variables)]
