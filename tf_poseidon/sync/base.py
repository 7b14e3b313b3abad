"""The contract every mode's synchronizer fulfils (one subclass per mode, one file each).

The strategy holds one synchronizer per process, built lazily on first use, and calls it from
the Keras optimizer integration (keras_integration.py) in a replica context, while the train
step is traced:

1. ``reduce_gradients(grads, variables, local_batch)`` — before the optimizer's update: returns
   the gradients the optimizer applies (sync: Σ_p g_p; modes that communicate parameters
   instead return the local gradient, see ``local_mean``).
2. ``after_update(variables)`` — after the optimizer has updated ``variables`` (in the same
   step): creates the ops of the mode's follow-up (stateful ops in a tf.function always run).
   SSP exchanges parameter deltas here, EASGD makes its elastic move.
3. ``consistent_state()`` — a context manager entered on every rank around saving, exporting,
   evaluating and predicting: within it every rank's variables hold the state to use, equal on
   every rank. ``drain()`` is the same without the context (SSP: apply everything pending).
4. ``tracing_replica_function()`` — a context manager the strategy enters while it runs (and so
   traces) the replica function; a synchronizer that needs to see the forward pass (SFB
   captures Dense layers' inputs) hooks in here.

Graph ops a synchronizer creates go through ``graph_ops`` with the strategy's Sequencer, so
they reach the engine in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import codecs, collectives


class Synchronizer:
    """Base class: the no-op parts of the contract above.

    ``lockstep``: whether every rank finishes every step together. Then per-step logs can be
    global for free; a mode whose ranks run ahead of each other (SSP, EASGD) must not add a
    per-step collective, so its progress bar shows rank 0's local metrics during an epoch (the
    epoch's logs and ``History`` are still global).
    """

    lockstep = True

    def __init__(self, engine, sequencer, config, num_replicas: int):
        self.engine = engine
        self.sequencer = sequencer
        self.config = config
        self.num_replicas = num_replicas
        self.bucket_bytes = config.bucket_bytes or buckets_lib.DEFAULT_BUCKET_BYTES
        self.first_bucket_bytes = min(self.bucket_bytes, buckets_lib.DEFAULT_FIRST_BUCKET_BYTES)
        # How the mode's exchanges are summed over ranks: MPI's all-reduce in the payload's
        # dtype, or 16 bits on the wire with float32 sums (compression="fp16"/"bf16").
        self.summing = (collectives.ALLREDUCE_SUM if config.compression == "none"
                        else codecs.compressed_allreduce(config.compression))

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        raise NotImplementedError

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        pass

    def drain(self) -> None:
        """Every rank: apply every pending update (blocking, collective)."""

    def consistent_state(self):
        self.drain()
        return contextlib.nullcontext()

    def tracing_replica_function(self):
        return contextlib.nullcontext()

    def stats(self) -> dict:
        """Mode-specific statistics for ``strategy.stats()["mode"]`` (JSON-serialisable)."""
        return {}

    def plan_buckets(self, values: Sequence[tf.Tensor],
                     backprop_order: bool = True) -> list[buckets_lib.Bucket]:
        """``values`` in buckets of the strategy's ``bucket_bytes`` (buckets.plan_buckets)."""
        return buckets_lib.plan_buckets(values, self.bucket_bytes, self.first_bucket_bytes,
                                        backprop_order)

    def local_mean(self, grads: Sequence[tf.Tensor],
                   local_batch: tf.Tensor | None = None) -> list[tf.Tensor]:
        """The gradient of the mean loss over this rank's batch: Keras scales every rank's loss
        by 1/P for a sum over ranks, which modes that apply local gradients undo. With
        ``local_batch`` (this rank's example count), a rank without examples gets zeros, even
        where its loss over no examples made NaN (one pass per gradient either way)."""
        factor = tf.constant(float(self.num_replicas))
        if local_batch is not None:
            factor = tf.where(local_batch > 0, factor, 0.0)
        return [tf.math.multiply_no_nan(g, tf.cast(factor, g.dtype)) for g in grads]


def variable_names(variables: Sequence[tf.Variable]) -> list[str]:
    """Names for statistics: the Keras path of each variable (``dense/kernel``)."""
    return [v.name.split(":")[0] for v in variables]
