"""Bulk synchronous parallel (mode="sync"): every step, every rank applies Σ_p g_p.

With compression="none", P ranks at global batch B give the weights of one process at batch B,
up to float summation order. With "fp16"/"bf16" the sum travels in 16 bits and is accumulated
in float32 (comm/codecs.py).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import codecs, collectives, graph_ops
from tf_poseidon.sync import batch_share
from tf_poseidon.sync.base import Synchronizer, variable_names


class BSPSynchronizer(Synchronizer):
    """Sums the gradients of all ranks through the engine, in buckets (see comm/buckets.py)."""

    def __init__(self, engine, sequencer, config, num_replicas):
        super().__init__(engine, sequencer, config, num_replicas)
        self._bucket_bytes = config.bucket_bytes or buckets_lib.DEFAULT_BUCKET_BYTES
        self._overlap = config.overlap
        self._collective = (collectives.ALLREDUCE_SUM if config.compression == "none"
                            else codecs.compressed_allreduce(config.compression))

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        """Returns Σ_p g_p for each gradient (same shapes and dtypes); called in a replica context.

        With ``local_batch`` (this rank's example count in the step), each rank's gradient is
        weighted by its share of the global batch (see batch_share.py). Blocking: in a graph,
        the returned tensors' ops block until the sums are there; eagerly, the call blocks.
        """
        values, names = list(grads), variable_names(variables)
        if local_batch is not None:
            values = batch_share.weight_by_share(values, local_batch)
            names.append("batch_share")
        plan = buckets_lib.plan_buckets(values, self._bucket_bytes,
                                        min(self._bucket_bytes,
                                            buckets_lib.DEFAULT_FIRST_BUCKET_BYTES))
        wait_for = list(values) if not self._overlap else []
        summed = graph_ops.bucketed_collective(self.engine, "gradients", values, plan,
                                               self._collective, self.sequencer,
                                               names, wait_for)
        if local_batch is not None:
            summed = batch_share.unweight_sum(summed, self.num_replicas)
        return summed
