"""The places where Keras 3 only knows TensorFlow's own strategies, taught about ours.

Keras 3's TensorFlow trainer special-cases ``MultiWorkerMirroredStrategy`` for the things a
multi-process strategy needs, and does not offer hooks for another one. :func:`install` wraps
twelve Keras functions; each wrapper acts only when the current strategy is a
:class:`~tf_poseidon.PoseidonStrategy` with more than one process and otherwise calls the
original unchanged:

* the optimizer's gradient all-reduce (``TFOptimizer._all_reduce_sum_gradients``) goes to the
  strategy's algorithm, so algorithms and buckets apply to gradients only;
* after the optimizer's update (``TFOptimizer._backend_update_step``) the algorithm gets its
  turn (``after_update``: SSP's delta exchange, EASGD's elastic move);
* gradient clipping (``BaseOptimizer._clip_gradients``: ``clipnorm``, ``global_clipnorm``,
  ``clipvalue``) moves from before that all-reduce, where Keras puts it and where it would see
  each rank's local gradient, to after it, so it clips the reduced gradient as one process
  would clip the gradient of the whole global batch;
* with ``gradient_accumulation_steps`` (``BaseOptimizer._backend_apply_gradients``), each
  micro-batch's gradient is weighted by the rank's share of that micro-batch before Keras
  accumulates it (one tiny all-reduce of the row counts per micro-batch), so an uneven or empty
  micro-batch weighs as it does in one process, and the update's reduction is a plain sum;
* ``LossScaleOptimizer.check_finite`` decides on every rank's gradients, not only the local
  ones: Keras checks the gradients *before* they are all-reduced, so a NaN on one rank would
  make that rank skip the step (and its all-reduce) while the others wait for it. The ranks'
  verdicts are combined (one tiny all-reduce), so all skip or all apply together;
* ``TensorFlowTrainer.train_step`` runs with batch-share weighting on (the replica context
  carries the local batch size; algorithms/batch_share.py):
  Keras' compiled loss is a mean over the local batch scaled by 1/P, which is the global mean
  only when the ranks' shares are equal, so an uneven last batch is reweighted. Custom loops
  keep the TensorFlow convention instead (``tf.nn.compute_average_loss(per_example_loss,
  global_batch_size=B)`` is exact as it is) and get plain sums. At the end of the step the
  model's non-trainable state (BatchNormalization's moving statistics) is made equal on every
  rank (``strategy.extended.synchronize_state``; batchnorm.py);
* ``BatchNormalization._moments`` uses the global batch's statistics (batchnorm.global_moments)
  for layers built with ``synchronized=True`` and for every layer under
  ``PoseidonStrategy(sync_batchnorm=True)``;
* ``Trainer.get_metrics_result`` computes each metric from the *sum over ranks* of its state
  variables, so logs, progress bars and ``History`` show the global values one process would
  show for the same global batch (true for every Keras metric whose state is a set of sums:
  Mean, Sum, the accuracies, Precision/Recall/AUC, MeanIoU, ...). Algorithms whose ranks run
  ahead of each other (SSP, EASGD: not ``lockstep``) reduce only at epoch ends, so their
  progress bars show rank 0's own metrics during an epoch;
* ``fit`` first checks that the model was built and compiled under the strategy's scope
  (scope_check.py), and ends with ``strategy.drain()`` (SSP applies its pending updates);
  ``evaluate`` / ``predict`` run inside ``strategy.extended.consistent_state()`` (SSP drains;
  EASGD uses the center), so what users measure and get is the state every rank agrees on;
* ``reduce_per_replica(..., "concat")`` (``predict``) concatenates the ranks' predictions in rank
  order, which is input order (see data.py), so every rank returns predictions for the whole
  input.

``install`` is idempotent; strategy.py calls it with PoseidonStrategy when it is imported.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.layers.normalization import batch_normalization as keras_batch_normalization
from keras.src.optimizers import base_optimizer as keras_base_optimizer
from keras.src.optimizers import loss_scale_optimizer as keras_loss_scale_optimizer
from keras.src.trainers import trainer as keras_trainer

from tf_poseidon import batchnorm
from tf_poseidon import data as data_lib
from tf_poseidon import scope_check
from tf_poseidon import timeouts

_strategy_class: type | None = None  # PoseidonStrategy, once installed


def _poseidon_extended(strategy=None):
    """``strategy``'s (default: the current strategy's) extended object if it is a
    PoseidonStrategy spanning several ranks, else None."""
    strategy = strategy or tf.distribute.get_strategy()
    if isinstance(strategy, _strategy_class) and strategy.num_replicas_in_sync > 1:
        return strategy.extended
    return None


def _wrap(owner, name: str, make_wrapper) -> None:
    original = getattr(owner, name)
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper.__tf_poseidon_original__ = original
    setattr(owner, name, wrapper)


def _all_reduce_sum_gradients(original):
    def wrapper(self, grads_and_vars):
        extended = _poseidon_extended()
        if extended is None or tf.distribute.get_replica_context() is None:
            return original(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        reduced = extended.reduce_gradients([grads_and_vars[i][0] for i in present],
                                            [grads_and_vars[i][1] for i in present])
        keras_clip = keras_base_optimizer.BaseOptimizer._clip_gradients.__tf_poseidon_original__
        reduced = keras_clip(self, reduced)
        result = [(None, v) for _, v in grads_and_vars]
        for i, g in zip(present, reduced):
            result[i] = (g, grads_and_vars[i][1])
        return result
    return wrapper


def _backend_update_step(original):
    def wrapper(self, grads, trainable_variables, learning_rate):
        original(self, grads, trainable_variables, learning_rate)
        extended = _poseidon_extended()
        if extended is not None and tf.distribute.get_replica_context() is not None:
            extended.after_update([v.value if isinstance(v, keras_backend.Variable) else v
                                   for v in trainable_variables])
    return wrapper


def _clip_gradients(original):
    def wrapper(self, grads):
        if _poseidon_extended() is not None and tf.distribute.get_replica_context() is not None:
            return grads  # clipped after the all-reduce instead
        return original(self, grads)
    return wrapper


def _check_finite(original):
    def wrapper(self, grads):
        finite = original(self, grads)
        extended = _poseidon_extended()
        if extended is None or tf.distribute.get_replica_context() is None:
            return finite
        if extended.config.algorithm.asynchronous:
            # Asynchronous EASGD: a rank applies only its own gradients and no collective sits
            # in the step, so it decides alone (a per-step all-reduce would make every rank
            # wait for the slowest).
            return finite
        all_finite = extended.sum_over_ranks([tf.cast(finite, tf.int64)], "finite")[0]
        return tf.equal(all_finite, extended._num_replicas_in_sync)
    return wrapper


def _train_step(original):
    def wrapper(self, data):
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None:
            return original(self, data)
        local_batch = data_lib.batch_size_of(data)
        with tf.distribute.get_replica_context().weighting_by_batch_share(local_batch):
            logs = original(self, data)
            extended.synchronize_state(self, local_batch)
        return logs
    return wrapper


def _backend_apply_gradients(original):
    def wrapper(self, grads, trainable_variables):
        extended = _poseidon_extended()
        context = tf.distribute.get_replica_context()
        local_batch = getattr(context, "local_batch", None)
        if extended is None or local_batch is None or not self.gradient_accumulation_steps:
            return original(self, grads, trainable_variables)
        # Accumulating micro-batches: each one's gradient is weighted by this rank's share of
        # that micro-batch before it is accumulated, and the update step's reduction is a
        # plain sum (the weights of different micro-batches differ).
        n_p = tf.cast(local_batch, tf.float32)
        total = extended.sum_over_ranks([tf.reshape(n_p, [1])], "micro_batch")[0][0]
        share = extended._num_replicas_in_sync * n_p / total
        grads = [_scaled(g, share) for g in grads]
        with context.weighting_by_batch_share(None):
            return original(self, grads, trainable_variables)
    return wrapper


def _scaled(grad, factor: tf.Tensor):
    """``grad`` (a tensor or IndexedSlices) times ``factor``, 0 where ``factor`` is 0."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_scaled(grad.values, factor), grad.indices, grad.dense_shape)
    return tf.math.multiply_no_nan(grad, tf.cast(factor, grad.dtype))


def _batchnorm_moments(original):
    def wrapper(self, inputs, mask):
        extended = _poseidon_extended()
        context = tf.distribute.get_replica_context()
        if (extended is None or context is None or mask is not None
                or not (self.synchronized or extended.config.sync_batchnorm)):
            return original(self, inputs, mask)
        return batchnorm.global_moments(extended, inputs, self._reduction_axes,
                                        getattr(context, "local_batch", None))
    return wrapper


def _fit(original):
    def wrapper(self, *args, **kwargs):
        scope_check.check_model_in_scope(self, _strategy_class)
        history = original(self, *args, **kwargs)
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is not None:
            extended.drain()
        return history
    return wrapper


def _in_consistent_state(original):
    def wrapper(self, *args, **kwargs):
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None:
            return original(self, *args, **kwargs)
        with extended.consistent_state():
            return original(self, *args, **kwargs)
    return wrapper


def _get_metrics_result(original):
    def wrapper(self):
        # Called in the train/test step (replica context) and eagerly at epoch ends by every
        # rank alike, so both places reduce; the model's own strategy decides.
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None or (extended.in_replica_function()
                                and not extended.config.algorithm.lockstep):
            return original(self)
        if not extended.config.algorithm.lockstep:
            timeouts.meet(extended.engine)  # ranks at their own pace: wait for the slowest
        metrics = list(self.metrics)
        states = [[v.value for v in m.variables] for m in metrics]
        flat = [s for state in states for s in state]
        summed = iter(extended.sum_over_ranks(flat, "metrics"))
        results = {}
        for metric, state in zip(metrics, states):
            value = metric.stateless_result([next(summed) for _ in state]) if state \
                else metric.result()
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        return results
    return wrapper


def _reduce_per_replica(original):
    def wrapper(values, strategy, reduction):
        extended = _poseidon_extended(strategy)
        if extended is not None and reduction == "concat":
            return tree.map_structure(lambda v: extended.gather_along(v, 0), values)
        return original(values, strategy, reduction)
    return wrapper


def install(strategy_class: type) -> None:
    """Installs the wrappers described in the module docstring (once); they act for
    ``strategy_class`` (PoseidonStrategy) with more than one rank."""
    global _strategy_class
    if _strategy_class is not None:
        return
    _strategy_class = strategy_class
    _wrap(keras_tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum_gradients)
    _wrap(keras_tf_optimizer.TFOptimizer, "_backend_update_step", _backend_update_step)
    _wrap(keras_base_optimizer.BaseOptimizer, "_clip_gradients", _clip_gradients)
    _wrap(keras_base_optimizer.BaseOptimizer, "_backend_apply_gradients",
          _backend_apply_gradients)
    _wrap(keras_loss_scale_optimizer.LossScaleOptimizer, "check_finite", _check_finite)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "train_step", _train_step)
    _wrap(keras_batch_normalization.BatchNormalization, "_moments", _batchnorm_moments)
    _wrap(keras_trainer.Trainer, "get_metrics_result", _get_metrics_result)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "fit", _fit)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "evaluate", _in_consistent_state)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "predict", _in_consistent_state)
    _wrap(keras_tf_trainer, "reduce_per_replica", _reduce_per_replica)
