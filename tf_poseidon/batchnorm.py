"""Batch normalization across ranks: global batch statistics, and moving statistics every rank
shares.

Two things, chosen by ``PoseidonStrategy(sync_batchnorm=...)`` (docs/synchronization.md):

* **Default** — each rank normalizes with its own batch's statistics in the forward pass (as
  Horovod and PyTorch DDP do), and after every training step the moving statistics, and every
  other non-trainable float variable of the model, are combined across ranks weighted by each
  rank's row count (:func:`combine_state`): a rank with zero rows contributes nothing (its NaN
  batch mean never reaches the model), and every rank then holds the same state, so
  ``evaluate``, ``predict``, checkpoints and exports agree. For the moving *mean* this is exactly
  one process's update; the moving variance misses the spread between the ranks' means.
* **Exact** — ``sync_batchnorm=True``, or a layer built with
  ``BatchNormalization(synchronized=True)``: the forward pass's batch mean and variance are those
  of the global batch (:func:`global_moments`: one fused all-reduce of Σx, Σx², count per layer,
  and one more in the backward pass), so P ranks train like one process, BN included. Costs two
  small collectives per BN layer per step, inside the forward and backward passes.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def global_moments(extended, x: tf.Tensor, axes: Sequence[int],
                   local_batch: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """Replica context, every rank alike (two collectives): the mean and variance of ``x``
    (float32) over ``axes`` across every rank's batch, as one process computes them on the
    global batch; shapes: x's with ``axes`` removed.

    The gradient is exact too: the all-reduce's gradient is the all-reduce of each rank's
    upstream gradient. When gradients are weighted by batch share (``local_batch`` given:
    Keras' ``fit``), each rank's upstream gradient is weighted by its share before that sum and
    unweighted after, so that the batch-share weighting of the parameter gradients leaves the
    other ranks' contributions as they were (an uneven last batch stays exact).
    """
    axes = list(axes)
    kept = [d for d in range(x.shape.rank) if d not in axes]
    local = tf.concat([tf.reshape(tf.reduce_sum(x, axes), [-1]),
                       tf.reshape(tf.reduce_sum(tf.square(x), axes), [-1]),
                       tf.reshape(tf.cast(tf.size(x) // tf.reduce_prod(
                           tf.gather(tf.shape(x), kept)), x.dtype), [1])], 0)
    total = _summed(extended, local, local_batch)
    channels = (tf.size(local) - 1) // 2
    count = total[-1]
    mean = tf.math.divide_no_nan(total[:channels], count)
    variance = tf.maximum(tf.math.divide_no_nan(total[channels:2 * channels], count)
                          - tf.square(mean), 0.0)
    shape = tf.gather(tf.shape(x), kept)
    return tf.reshape(mean, shape), tf.reshape(variance, shape)


def _summed(extended, local: tf.Tensor, local_batch: tf.Tensor | None) -> tf.Tensor:
    """Σ over ranks of ``local`` (whose last element is this rank's count), differentiable."""
    num_replicas = extended._num_replicas_in_sync

    @tf.custom_gradient
    def all_reduce(value):
        total = extended.sum_over_ranks([value], "batchnorm")[0]

        def grad(upstream):
            if local_batch is None:
                return extended.sum_over_ranks([upstream], "batchnorm_grad")[0]
            share = num_replicas * value[-1] / total[-1]  # this rank's weight n_p·P/n
            summed = extended.sum_over_ranks([upstream * share], "batchnorm_grad")[0]
            return tf.math.divide_no_nan(summed, share)
        return total, grad
    return all_reduce(local)


def state_variables(model) -> list[tf.Variable]:
    """The model's non-trainable float variables: the state :func:`combine_state` shares."""
    return [v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v
            for v in model.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating]


def combine_state(extended, variables: Sequence[tf.Variable],
                  local_batch: tf.Tensor | None) -> None:
    """Replica context or eager, every rank alike (one collective): every variable becomes the
    mean of the ranks' values, weighted by ``local_batch`` (each rank's row count; None: equal
    weights). A rank whose weight is 0 contributes nothing, even where its value is NaN."""
    if not variables:
        return
    weight = tf.constant(1.0) if local_batch is None else tf.cast(local_batch, tf.float32)
    weighted = [tf.math.multiply_no_nan(v.read_value(), tf.cast(weight, v.dtype))
                for v in variables]
    *sums, total = extended.sum_over_ranks(weighted + [tf.reshape(weight, [1])], "state")
    for variable, summed in zip(variables, sums):
        variable.assign(summed / tf.cast(total[0], summed.dtype))
