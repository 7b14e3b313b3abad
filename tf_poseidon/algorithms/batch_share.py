"""Weighting by batch share, so an uneven last batch gives one process's gradient.

Keras computes each replica's loss as the mean over its local examples, scaled by 1/P, and
sums the replicas' gradients. When the global batch of n examples splits unevenly (n_p examples
on rank p), that sum is Σ_p mean_p / P, not the mean over all n examples that one process
computes. Sending n_p·g_p together with n_p and scaling the sum by P/Σn_p gives exactly
Σ_p (n_p/n)·mean_p, the one-process gradient. For even batches the factors cancel (to rounding).
"""

from __future__ import annotations

import tensorflow as tf


class Weighting:
    """One step's weighting by this rank's example count ``local_batch`` (a scalar tensor) on
    ``num_replicas`` ranks.

    ``apply`` each value before the sum, send ``count`` (n_p as a float32 vector of length 1)
    with them, and multiply each sum by ``unweighting(sum of count)``.
    """

    def __init__(self, local_batch: tf.Tensor, num_replicas: int):
        self.num_replicas = num_replicas
        self.n_p = tf.cast(local_batch, tf.float32)
        self.count = tf.reshape(self.n_p, [1])

    def apply(self, value: tf.Tensor) -> tf.Tensor:
        """n_p·value; a rank with no examples (a last batch with fewer examples than ranks)
        sends zeros, whatever its loss computed on an empty batch (one pass per value)."""
        return tf.math.multiply_no_nan(value, tf.cast(self.n_p, value.dtype))

    def unweighting(self, total: tf.Tensor) -> tf.Tensor:
        """P/Σ_p n_p from the summed ``count``."""
        return self.num_replicas / total[0]
