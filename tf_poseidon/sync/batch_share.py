"""Weighting by batch share, so an uneven last batch gives one process's gradient.

Keras computes each replica's loss as the mean over its local examples, scaled by 1/P, and
sums the replicas' gradients. When the global batch of n examples splits unevenly (n_p examples
on rank p), that sum is Σ_p mean_p / P, not the mean over all n examples that one process
computes. Sending n_p·g_p together with n_p and scaling the sum by P/Σn_p gives exactly
Σ_p (n_p/n)·mean_p, the one-process gradient. For even batches the factors cancel (to rounding).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def weight_by_share(grads: Sequence[tf.Tensor], local_batch: tf.Tensor) -> list[tf.Tensor]:
    """Returns ``[n_p·g for g in grads] + [n_p]`` (n_p as a float32 vector of length 1).

    A rank with no examples (n_p = 0, possible when the last batch has fewer examples than
    ranks) sends zeros, whatever its loss computed on an empty batch.
    """
    n_p = tf.cast(local_batch, tf.float32)
    # multiply_no_nan: 0 where n_p is 0, even for a NaN gradient; one pass per gradient.
    weighted = [tf.math.multiply_no_nan(g, tf.cast(n_p, g.dtype)) for g in grads]
    return weighted + [tf.reshape(n_p, [1])]


def unweight_sum(summed: Sequence[tf.Tensor], num_replicas: int) -> list[tf.Tensor]:
    """Inverse of :func:`weight_by_share` after the sum: ``[s·P/n for s in sums]``."""
    *sums, total = summed
    factor = num_replicas / total[0]
    return [s * tf.cast(factor, s.dtype) for s in sums]
