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
  of the global batch (:func:`global_moments`: one all-gather of each rank's count, mean and
  squared deviations per layer, and one all-reduce in the backward pass), so P ranks train like
  one process, BN included. Costs two small collectives per BN layer per step, inside the
  forward and backward passes.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def global_moments(extended, x: tf.Tensor, axes: Sequence[int],
                   local_batch: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """Replica context, every rank alike (two collectives): the mean and variance of ``x``
    (float32) over ``axes`` across every rank's batch, as one process computes them on the
    global batch; shapes: x's with ``axes`` removed.

    Each rank computes its own rows' count, mean and sum of squared deviations (two passes, as
    ``tf.nn.moments`` does for one process); one all-gather gives every rank every rank's
    figures, which it combines without cancellation (Chan et al.: M2 = Σ_p M2_p +
    Σ_p n_p (m_p − m)², m the global mean) — the one-pass E[x²] − E[x]² loses the variance of a
    channel whose mean is large against its spread, and with it exactness. The gradient is
    exact too: the all-gather's gradient is each rank's row of the sum over ranks of their
    upstream gradients. When gradients are weighted by batch share (``local_batch`` given:
    Keras' ``fit``), each rank's upstream gradient is weighted by its share before that sum and
    unweighted after, so that the batch-share weighting of the parameter gradients leaves the
    other ranks' contributions as they were (an uneven last batch stays exact).
    """
    axes = list(axes)
    kept = [d for d in range(x.shape.rank) if d not in axes]
    count = tf.cast(tf.size(x) // tf.reduce_prod(tf.gather(tf.shape(x), kept)), x.dtype)
    mean, variance = tf.nn.moments(x, axes)
    has_rows = count > 0  # a rank without rows: NaN moments, which weigh nothing
    mean = tf.where(has_rows, mean, tf.zeros_like(mean))
    squares = tf.where(has_rows, variance * count, tf.zeros_like(variance))
    local = tf.concat([tf.reshape(count, [1]), tf.reshape(mean, [-1]),
                       tf.reshape(squares, [-1])], 0)
    channels = tf.TensorShape([x.shape[d] for d in kept]).num_elements()  # static: the layer's
    local.set_shape([1 + 2 * channels])
    everyone = _gathered(extended, local, local_batch)  # [P, 1 + 2C]
    counts = everyone[:, :1]
    means, all_squares = everyone[:, 1:1 + channels], everyone[:, 1 + channels:]
    total = tf.reduce_sum(counts)
    global_mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), total)
    spread = tf.reduce_sum(all_squares, 0) + tf.reduce_sum(
        counts * tf.square(means - global_mean), 0)
    shape = tf.gather(tf.shape(x), kept)
    return (tf.reshape(global_mean, shape),
            tf.reshape(tf.math.divide_no_nan(spread, total), shape))


def _gathered(extended, local: tf.Tensor, local_batch: tf.Tensor | None) -> tf.Tensor:
    """Every rank's ``local`` (whose first element is its count), stacked in rank order;
    differentiable."""
    num_replicas = extended._num_replicas_in_sync
    rank = extended._world.rank

    @tf.custom_gradient
    def all_gather(value):
        everyone = tf.reshape(extended.gather_along(value[tf.newaxis], 0),
                              [num_replicas, value.shape[0]])

        def grad(upstream):
            if local_batch is None:
                return extended.sum_over_ranks([upstream], "batchnorm_grad")[0][rank]
            share = num_replicas * value[0] / tf.reduce_sum(everyone[:, 0])  # n_p·P/n
            summed = extended.sum_over_ranks([upstream * share], "batchnorm_grad")[0][rank]
            return tf.math.divide_no_nan(summed, share)
        return everyone, grad
    return all_gather(local)


def state_variables(model, sync_batchnorm: bool) -> list[tf.Variable]:
    """The model's non-trainable float variables that :func:`combine_state` shares: all but
    the moving statistics of BatchNormalization layers that use global moments
    (``synchronized=True``, or every layer with ``sync_batchnorm``), which every rank computes
    from the same figures already (averaging them would only add rounding)."""
    import keras
    shared = {id(v) for layer in model._flatten_layers(include_self=False)
              if isinstance(layer, keras.layers.BatchNormalization)
              and (sync_batchnorm or layer.synchronized)
              for v in layer.non_trainable_variables}
    return [v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v
            for v in model.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating and id(v) not in shared]


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
