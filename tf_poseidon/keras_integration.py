"""The places where Keras 3 only knows TensorFlow's own strategies, taught about ours.

Keras 3's TensorFlow trainer special-cases ``MultiWorkerMirroredStrategy`` for the things a
multi-process strategy needs, and does not offer hooks for another one. :func:`install` wraps
the Keras functions below; each wrapper acts only when the current strategy is a
:class:`~tf_poseidon.PoseidonStrategy` with more than one process and otherwise calls the
original unchanged:

* the optimizer's gradient all-reduce (``TFOptimizer._all_reduce_sum_gradients``) goes to the
  strategy's algorithm, so algorithms and buckets apply to gradients only, telling it whether
  the optimizer applies an embedding's rows one by one (every update rule but SGD's, and
  clipping, treat duplicate rows differently from their sum: then only sparse rows give one
  process's update);
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
  only when the ranks' shares are equal, so an uneven last batch is reweighted. ``test_step``
  runs the same way, and a loss whose Keras normalizer is not proportional to the rows (a
  mask, "mean_with_sample_weight", "sum") is corrected where Keras reduces it (next item).
  Custom loops keep the TensorFlow convention instead (``tf.nn.compute_average_loss(
  per_example_loss, global_batch_size=B)`` is exact as it is) and get plain sums;
* Keras' TensorFlow ``random.dropout``, ``uniform``, ``normal`` and ``randint``, in the train
  and test steps (``_make_function``, below: Keras' own and a model's own) of a model with a
  layer or a seed generator of its own that draws: each rank draws its rows of the draw one
  process makes for the whole global batch (batch_draws.py; one tiny all-reduce of the ranks'
  row counts per step), so Dropout masks, Gaussian noise, per-image augmentations and the
  noise a custom ``train_step`` draws for its batch (a GAN's latent vectors) are one
  process's instead of the same for every rank's rows;
* ``keras.src.losses.loss.reduce_weighted_values``, in those steps of a lockstep algorithm:
  a loss divided by a normalizer that is not proportional to the rank's rows is multiplied by
  the factor that makes the batch-share weighted sum one process's loss (one tiny all-reduce
  per loss; docs/synchronization.md, "Masked losses");
* ``CompileLoss.call``: the per-output loss metrics of a model with several outputs, which Keras
  records with weight 1 per batch of unknown size, are weighted by each rank's share of the
  global batch (one tiny all-reduce of the row counts per step), so evaluate and History show
  one process's values also on an uneven batch; in a step run eagerly (``run_eagerly=True``),
  where the batch size is known, a rank without rows records nothing and its loss is 0, as in
  a traced step (Keras' loss of an empty batch is an empty tensor, a NaN in a Mean metric);
* ``BatchNormalization._moments`` uses the global batch's statistics (batchnorm.global_moments)
  for layers built with ``synchronized=True`` and for every layer under
  ``PoseidonStrategy(sync_batchnorm=True)``;
* ``RNN._create_state_variables``: a ``stateful=True`` RNN built from the model's static batch
  size (``keras.Input(batch_size=B)``, as Keras asks of stateful RNNs) outside a step, where
  that size is the global batch's, holds the states of this rank's rows of it only
  (stateful_rnn.py: the states of all ranks together are one process's). ``RNN.call`` then
  refuses a batch whose share differs, as Keras refuses a batch of another size in one
  process, with a message naming the global batch the model was built for;
* ``Trainer.get_metrics_result`` computes each metric from its state variables *combined over
  ranks*, each as its ``aggregation`` says (summed, every Keras metric's; averaged; rank 0's),
  so logs, progress bars and ``History`` show the global values one process would show for
  the same global batch (Mean, Sum, the accuracies, Precision/Recall/AUC, MeanIoU, ...).
  Algorithms whose ranks run ahead of each other (SSP, EASGD: not ``lockstep``) reduce only
  at epoch ends, so their progress bars show rank 0's own metrics during an epoch;
* ``TensorFlowTrainer._make_function`` (the train and test functions, for Keras' steps and
  for a model's own ``train_step``/``test_step``) runs the step so that:

  - at the end of every training step, whichever ``train_step`` it runs (Keras' own or a
    subclass's, which never calls the wrapped one), the model's non-trainable state
    (BatchNormalization's moving statistics) is made equal on every rank, each rank weighted by
    the rows of its step (``strategy.extended.synchronize_state``; batchnorm.py). This is the
    depth that knows the model, the step's rows and that the step is a training step; the
    optimizer does not know the model, runs once per optimizer (a GAN's step has two) and, with
    ``gradient_accumulation_steps``, updates only every k-th step, while the state changes in
    every step's forward pass;
  - on a rank without rows in the step, the model's Mean and Sum metrics (Keras' loss
    tracker, a custom step's trackers) record nothing: a loss that is a mean over the rows (a
    layer's ``add_loss``, a custom step's ``ops.mean``) is NaN for no rows, which a Mean
    would record as NaN even at weight 0 (the gradients of no rows are zeros);
  - a metric of ``model.metrics`` whose ``result()`` the step calls itself (the Keras guide's
    custom ``train_step`` returns ``{m.name: m.result() for m in self.metrics}``) computes it
    from its state combined over ranks too, as ``get_metrics_result`` does (the two never
    reduce twice: a result computed from combined state is not combined again);
  - with ``compile(jit_compile=True)`` XLA compiles the step, except the communication:
    Keras would compile the whole step as one XLA function, which cannot hold the ops that
    hand tensors to the engine thread. Instead the step is traced in an XLA ``jit_scope``,
    so TensorFlow compiles everything it can (forward and backward pass, optimizer update,
    metric updates) into clusters around the communication ops, which run as ordinary ops
    (``predict`` needs nothing: Keras compiles only its ``predict_step`` and gathers the
    outputs outside). The backward pass then ends as one compiled cluster, so every bucket
    is handed to the engine when all gradients exist (no overlap with backprop). A model
    that computes in 16-bit floats (a ``mixed_float16``/``mixed_bfloat16`` policy) is refused
    at its first ``fit``/``evaluate``: where 16-bit values are rounded depends on how XLA
    fuses the step, and clusters around the communication ops fuse differently from one
    process's whole-step function, so P ranks would not give one process's results
    (docs/synchronization.md);
* ``fit`` first checks that the model was built and compiled under the strategy's scope
  (scope_check.py; a model under no strategy trains as plain Keras, with a warning on rank 0
  in a job of several ranks: each rank trains its own copy), refuses Keras' own
  ModelCheckpoint and BackupAndRestore (every rank would write the same files:
  ``tp.callbacks`` has their multi-rank forms) and runs Keras' CSVLogger and TensorBoard on
  rank 0 only (callbacks.for_this_rank), and ends with ``strategy.drain()`` (SSP applies its
  pending updates);
  ``evaluate`` / ``predict`` run inside ``strategy.extended.consistent_state()`` (SSP drains;
  EASGD uses the center), so what users measure and get is the state every rank agrees on;
* ``reduce_per_replica(..., "concat")`` (``predict``) concatenates the ranks' predictions in rank
  order, which is input order (see data.py), so every rank returns predictions for the whole
  input;
* ``TFEpochIterator.__init__`` (``fit``, ``evaluate``, ``predict``): the ranks check that they
  were given the same global data (batches per epoch, batch size, last batch's size, the seeds
  of a ``tf.data`` pipeline's shuffles and its ``shard``/``skip`` calls, a digest of the
  values of arrays or of the tensors a pipeline starts from; one small all-gather), or every
  rank raises saying what each got and what to do; a pipeline that shuffles without a seed is
  refused before that. The dataset Keras' adapter makes of the input is then distributed
  without the strategy's own check of a pipeline (``experimental_distribute_dataset``, which
  custom loops use), which knows less: Keras' ``__init__`` runs here in full;
* ``TensorFlowTrainer._maybe_symbolic_build`` (``fit``, ``evaluate``), under a PoseidonStrategy
  of any size: Keras under a strategy pulls one batch from the input to build the model
  symbolically, which plain Keras never does, and a pipeline that draws (an augmentation
  mapped over the batches) would then go on from other draws. The build takes its shapes from
  the distributed dataset's ``element_spec`` instead and pulls nothing, unless a dimension
  other than the batch's is unknown there (a model built from such shapes could differ from
  one built from a batch, or fail where Keras' pull succeeds): then Keras pulls its batch. A
  model without a ``call()`` of its own (only a ``train_step``: the Keras guide's GAN), which
  Keras under a strategy cannot build symbolically ("Unable to automatically build the
  model"), is not: as in plain Keras, its parts are built when its step is traced;
* ``Model.save``, ``save_weights`` and ``export``: Keras writes from every process, so
  every rank would write the same path at once (h5py's lock error ends the job, or the writes
  interleave) and each write truncates the file before the new one is complete. Every rank
  still calls them (collective and blocking, as ``tp.callbacks`` and
  ``tp.export_for_serving``); rank 0 writes, from ``consistent_state()`` (one file
  atomically), and every rank returns once the write is complete (export.save_on_chief);
* TensorFlow's ``tf.train.Checkpoint`` (``save``, ``write``, ``tf.train.CheckpointManager.save``:
  ``Checkpoint._write``), as a custom loop checkpoints a model: TensorFlow writes a checkpoint
  through temporary files of fixed names, so ranks writing one prefix at once delete each
  other's (``MergeV2Checkpoints``: "... did not exist"). For a checkpoint that tracks a model
  created under the strategy, every rank still calls them, rank 0 writes (the state file and
  deletions of old checkpoints too), and every rank returns once the files are in place, with
  the same ``save_counter`` and ``latest_checkpoint``; asynchronous checkpoints are refused.
  ``tf.saved_model.save`` of such a model, which writes its variables the same way, likewise;
* ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``: Keras hands the batch as it
  is to every replica, so each rank would run the whole batch (P ranks doing one process's
  work), a Dropout would draw its masks as for a batch P times as large, and
  ``predict_on_batch`` would return the batch's predictions P times over. The batch is taken
  as the global batch instead, the same on every rank as ``fit``'s data is (in a lockstep
  algorithm the ranks check that it is: one small all-gather of each batch's shapes and a
  digest of a sample of its values, or every rank raises), and each rank runs its rows of it
  (data.slice_for_rank); ``test_on_batch`` and ``predict_on_batch`` run inside
  ``consistent_state()``, as ``evaluate`` and ``predict`` do, and ``test_on_batch`` returns
  the metrics of the whole batch also where the algorithm is not lockstep;
* ``fit(x, y, shuffle=True)`` on arrays: Keras shuffles the sample indices with a
  ``tf.random.shuffle`` without an op seed, so ranks would slice different permutations (some
  samples seen twice in an epoch, others never) unless seeded alike. The shuffled dataset is
  rebuilt for every epoch (``TFEpochIterator._get_iterator``) under a graph seed every rank
  agrees on (data.agreed_permutation_seeds, decided by rank 0 when ``fit`` starts): with a
  global seed, one process's permutation, which one process repeats in every epoch; without,
  a fresh one per epoch. Every rank slices the same permutation and every sample is trained
  on exactly once per epoch;
* ``fit(py_dataset)`` (shuffled by default): Keras shuffles the batches' order with Python's
  ``random``, each process's own, so at one step the ranks would slice different global
  batches. ``TFEpochIterator.__init__`` turns that shuffle off and serves the batches through
  ``data.AgreedBatchOrder``, which shuffles as Keras does with rank 0's ``random`` (its state
  when ``fit`` starts) whenever a pass over the batches starts: in
  ``PyDatasetAdapter._finite_generator``, or ``OrderedEnqueuer._run`` where the PyDataset has
  workers.

``install`` is idempotent; strategy.py calls it with PoseidonStrategy when it is imported.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import queue
import threading

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.layers.normalization import batch_normalization as keras_batch_normalization
from keras.src.layers.rnn import dropout_rnn_cell as keras_dropout_rnn_cell
from keras.src.layers.rnn import rnn as keras_rnn
from keras.src.losses import loss as keras_loss
from keras.src.metrics import reduction_metrics as keras_reduction_metrics
from keras.src.models import model as keras_model
from keras.src.optimizers import base_optimizer as keras_base_optimizer
from keras.src.optimizers import loss_scale_optimizer as keras_loss_scale_optimizer
from keras.src.optimizers import sgd as keras_sgd
from keras.src.random import seed_generator as keras_seed_generator
from keras.src.trainers import compile_utils as keras_compile_utils
from keras.src.trainers import epoch_iterator as keras_epoch_iterator
from keras.src.trainers import trainer as keras_trainer
from keras.src.trainers.data_adapters import array_data_adapter, py_dataset_adapter
from keras.src.utils import python_utils as keras_python_utils
from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
from tensorflow.python.checkpoint import checkpoint_management as tf_checkpoint_management

from tf_poseidon import batch_draws, batchnorm
from tf_poseidon import callbacks as callbacks_lib
from tf_poseidon import data as data_lib
from tf_poseidon import export
from tf_poseidon import scope_check
from tf_poseidon import stateful_rnn
from tf_poseidon import timeouts, world

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
        with tf.distribute.get_replica_context().applying_rows(_applies_rows_one_by_one(self)):
            reduced = extended.reduce_gradients([grads_and_vars[i][0] for i in present],
                                                [grads_and_vars[i][1] for i in present])
        keras_clip = keras_base_optimizer.BaseOptimizer._clip_gradients.__tf_poseidon_original__
        reduced = keras_clip(self, reduced)
        result = [(None, v) for _, v in grads_and_vars]
        for i, g in zip(present, reduced):
            result[i] = (g, grads_and_vars[i][1])
        return result
    return wrapper


def _applies_rows_one_by_one(optimizer) -> bool:
    """Whether ``optimizer`` updates an ``IndexedSlices`` gradient with duplicate rows
    differently from their sum: every Keras update rule but SGD's squares or divides the rows
    one by one (Adam, AdamW, RMSprop, Adagrad, Nadam, ...), and clipping (``clipnorm``,
    ``global_clipnorm``, ``clipvalue``) measures them one by one."""
    clipped = any(getattr(optimizer, name, None) is not None
                  for name in ("clipnorm", "global_clipnorm", "clipvalue"))
    return clipped or type(optimizer).update_step is not keras_sgd.SGD.update_step


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


def _by_batch_share(original):
    """Keras' train_step and test_step: run with this rank's row count in the replica context,
    which weights the step's gradient reduction and corrects its loss reductions
    (:func:`_reduce_weighted_values`)."""
    def wrapper(self, data):
        if _poseidon_extended(getattr(self, "distribute_strategy", None)) is None:
            return original(self, data)
        with tf.distribute.get_replica_context().weighting_by_batch_share(
                data_lib.batch_size_of(data)):
            return original(self, data)
    return wrapper


def _draw_window(model, extended, rows: tf.Tensor | None) -> batch_draws.RowsWindow | None:
    """``model``'s rows window for a step of ``rows`` rows: agreed by the ranks (one tiny
    all-reduce) where the algorithm is lockstep, so that the draws are one process's; assumed
    without communication otherwise (SSP, EASGD: no collective in a step, and no one process
    to equal), so that the ranks draw apart. None for a model that never draws: no layer has a
    seed generator but RNN cells without dropout (every Keras RNN cell has one)."""
    if rows is None or not any(_may_draw(layer) for layer in model._flatten_layers()):
        return None
    rank, size, xla = extended._world.rank, extended._num_replicas_in_sync, _compiles(model)
    if extended.config.algorithm.lockstep:
        return batch_draws.agreed_window(rows, rank, size, xla, extended.sum_over_ranks)
    return batch_draws.assumed_window(rows, rank, size, xla)


def _may_draw(layer) -> bool:
    if isinstance(layer, keras_dropout_rnn_cell.DropoutRNNCell):
        return bool(layer.dropout or layer.recurrent_dropout)
    return bool(layer._seed_generators)


def _drawn(by_rows):
    """Keras' TensorFlow ``random.<name>`` as ``by_rows(window, *args, **kwargs)`` (the same
    arguments, the same draw of the seed) draws it where the replica context has a rows
    window (a train or test step under a multi-rank strategy: :func:`_make_function`)."""
    def wrap(original):
        def wrapper(*args, **kwargs):
            window = getattr(tf.distribute.get_replica_context(), "draw_window", None)
            if window is None:
                return original(*args, **kwargs)
            return by_rows(window, *args, **kwargs)
        return wrapper
    return wrap


def _keras_seed(seed) -> tf.Tensor:
    return keras_tf_random._cast_seed(keras_seed_generator.draw_seed(seed))


def _dropout_by_rows(window, inputs, rate, noise_shape=None, seed=None):
    if rate == 1.0:
        return tf.zeros_like(inputs)
    if rate == 0.0:
        return inputs
    seed = _keras_seed(seed)
    return tf.nn.experimental.general_dropout(
        inputs, rate, lambda shape, dtype: batch_draws.uniform(shape, seed, dtype, window),
        noise_shape=keras_tf_random._get_concrete_noise_shape(inputs, noise_shape))


def _uniform_by_rows(window, shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    dtype = dtype or keras_backend.floatx()
    return batch_draws.uniform(shape, _keras_seed(seed), dtype, window, tf.cast(minval, dtype),
                               tf.cast(maxval, dtype))


def _randint_by_rows(window, shape, minval, maxval, dtype="int32", seed=None):
    drawn_as = dtype if keras_backend.standardize_dtype(dtype) in ("int32", "int64") else "int64"
    return tf.cast(batch_draws.randint(shape, _keras_seed(seed), drawn_as, window, minval,
                                       maxval), dtype)


def _normal_by_rows(window, shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    return batch_draws.normal(shape, _keras_seed(seed), dtype or keras_backend.floatx(),
                              window, mean, stddev)


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


def _reduce_weighted_values(original):
    """Keras' reduction of a loss's per-element values, in a lockstep algorithm's Keras step
    (the replica context carries the rank's rows): times a factor that makes the ranks' losses,
    weighted by batch share as the step weighs them, add up to one process's loss.

    Keras divides a rank's weighted sum of losses S_p by a normalizer (times P) taken from the
    rank's own data; one process divides the global sum by the global normalizer. Where the
    normalizer is proportional to the rank's rows (no mask, no "mean_with_sample_weight") the
    batch-share weighting already gives one process's loss and nothing changes. Where it is
    not (a mask: the count of unmasked elements; "mean_with_sample_weight": the sum of the
    weights; "sum": none), the loss is multiplied by (n_p / Σn) / (rows_p / Σrows), n_p being
    :func:`_loss_normalizer`'s value: one tiny all-reduce of (rows, n_p) per loss.
    """
    def wrapper(values, sample_weight=None, mask=None, reduction="sum_over_batch_size",
                dtype=None):
        loss = original(values, sample_weight=sample_weight, mask=mask, reduction=reduction,
                        dtype=dtype)
        extended = _poseidon_extended()
        local_batch = getattr(tf.distribute.get_replica_context(), "local_batch", None)
        if extended is None or local_batch is None or not extended.config.algorithm.lockstep:
            return loss
        normalizer = _loss_normalizer(tf.convert_to_tensor(values), sample_weight, mask,
                                      reduction)
        if normalizer is None:
            return loss
        rows = tf.cast(local_batch, tf.float32)
        totals = extended.sum_over_ranks([tf.stack([rows, normalizer])], "loss_normalizer")[0]
        factor = tf.math.divide_no_nan(normalizer * totals[0], totals[1] * rows)
        return loss * tf.cast(factor, loss.dtype)
    return wrapper


def _loss_normalizer(values: tf.Tensor, sample_weight, mask,
                     reduction: str | None) -> tf.Tensor | None:
    """What Keras 3.15's ``reduce_weighted_values`` divides this rank's weighted sum of
    ``values`` by (a float32 scalar), up to a factor every rank shares (it cancels in
    n_p / Σn), where that is not proportional to the rank's rows; None where it is, or where
    Keras does not reduce. "sum" divides by nothing where a mean divides by P: 1 per rank."""
    reduction = keras_loss.standardize_reduction(reduction)
    if reduction in (None, "none") or tuple(values.shape) in ((), (0,)):
        return None
    if reduction == "sum":
        return tf.constant(1.0)
    if reduction == "mean_with_sample_weight":
        weights = keras_loss.apply_mask(sample_weight, mask, dtype=values.dtype,
                                        reduction=reduction)
        return None if weights is None else tf.reduce_sum(tf.cast(weights, tf.float32))
    if mask is None:
        return None
    # "sum_over_batch_size" and "mean" weigh unmasked elements by size(mask) / count.
    mask = tf.cast(mask, tf.float32)
    return tf.math.divide_no_nan(tf.reduce_sum(mask) * tf.cast(tf.size(values), tf.float32),
                                 tf.cast(tf.size(mask), tf.float32))


def _compile_loss_call(original):
    def wrapper(self, y_true, y_pred, sample_weight=None):
        extended = _poseidon_extended()
        context = tf.distribute.get_replica_context()
        first = next((t for t in tree.flatten(y_pred) if t is not None), None)
        if extended is None or context is None or first is None:
            return original(self, y_true, y_pred, sample_weight)
        if first.shape[0] == 0:
            # A rank without rows whose batch size is known (a step run eagerly): Keras' loss
            # of an empty batch is an empty tensor, which a Mean metric records as NaN even at
            # weight 0. This rank records nothing and its loss is 0, as in a traced step.
            with _weighted_updates(self.metrics, None):
                total = original(self, y_true, y_pred, sample_weight)
            return None if total is None else tf.reduce_sum(total)
        if not self.metrics or first.shape[0] is not None:
            return original(self, y_true, y_pred, sample_weight)
        # Keras records each output's loss with weight 1 per batch when the batch dimension is
        # unknown (shape[0] is None), i.e. per *rank* here: each rank's record is weighted by
        # its share of the global batch instead (one tiny all-reduce of the row counts), so
        # that an uneven batch's ranks together weigh what one process's batch weighs.
        rows = tf.cast(tf.shape(first)[0], tf.float32)
        total = extended.sum_over_ranks([tf.reshape(rows, [1])], "loss_rows")[0][0]
        share = tf.math.divide_no_nan(rows * extended._num_replicas_in_sync, total)
        with _weighted_updates(self.metrics, share):
            return original(self, y_true, y_pred, sample_weight)
    return wrapper


def _weighted_updates(metrics, weight: tf.Tensor | None):
    """Within it, ``update_state`` of each of ``metrics`` called without a sample weight uses
    ``weight``, and with ``weight`` None records nothing."""
    def update_state(update, values, sample_weight):
        if weight is None:
            return None
        return update(values, sample_weight=weight if sample_weight is None else sample_weight)
    return _updates_through(metrics, update_state)


def _means_of_rows_only(model, rows: tf.Tensor | None):
    """Within it, where ``rows`` (the rank's rows in the step) is 0, the Mean and Sum metrics
    of ``model`` (Keras' loss tracker and ``model.metrics``, not the metrics of a
    ``(y_true, y_pred)`` form) record nothing, whatever they are fed (NaN too)."""
    plain = (keras_reduction_metrics.Mean.update_state, keras_reduction_metrics.Sum.update_state)
    metrics = [] if rows is None else [
        m for m in dict.fromkeys([getattr(model, "_loss_tracker", None), *model.metrics])
        if getattr(type(m), "update_state", None) in plain]

    def update_state(update, values, sample_weight):
        values = tf.convert_to_tensor(values)
        has_rows = tf.cast(rows > 0, values.dtype)
        return update(tf.math.multiply_no_nan(values, has_rows), sample_weight=has_rows if
                      sample_weight is None else tf.cast(sample_weight, values.dtype) * has_rows)
    return _updates_through(metrics, update_state)


@contextlib.contextmanager
def _updates_through(metrics, through):
    """Within it, each of ``metrics``' ``update_state(values, sample_weight=None)`` calls
    ``through(update, values, sample_weight)``, ``update`` being the metric's update as it was
    on entry (instance attributes shadowing the method, restored on exit: these nest)."""
    def shadowing(update):
        def update_state(values, sample_weight=None):
            return through(update, values, sample_weight)
        return update_state

    outer = [metric.__dict__.get("update_state") for metric in metrics]
    for metric in metrics:
        metric.update_state = shadowing(metric.update_state)
    try:
        yield
    finally:
        for metric, update in reversed(list(zip(metrics, outer))):
            if update is None:
                del metric.update_state
            else:
                metric.update_state = update


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


def _rows_of_rnn_state(original):
    def wrapper(self, batch_size):
        extended = _poseidon_extended()
        if extended is None or not tf.distribute.in_cross_replica_context():
            return original(self, batch_size)
        stateful_rnn.create_rank_states(self, batch_size, extended)
    return wrapper


def _rnn_call(original):
    def wrapper(self, sequences, *args, **kwargs):
        stateful_rnn.check_rows(self, sequences)
        return original(self, sequences, *args, **kwargs)
    return wrapper


def _fit(original):
    signature = inspect.signature(original)

    def wrapper(self, *args, **kwargs):
        scope_check.check_model_in_scope(self, _strategy_class)
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None:
            scope_check.warn_if_trained_alone(self, world.size(), world.rank())
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("callbacks") is not None:
            bound.arguments["callbacks"] = callbacks_lib.for_this_rank(
                bound.arguments["callbacks"], extended._world.rank)
        history = original(*bound.args, **bound.kwargs)
        extended.drain()
        return history
    return wrapper


def _saved_by_rank0(original):
    """``Model.save``, ``save_weights`` and ``export`` under a multi-process PoseidonStrategy:
    every rank calls them (collective, blocking), rank 0 writes, from the consistent state,
    into a temporary renamed over the target (export.save_on_chief). In place instead where
    the write is several files or a directory (``export``, ``max_shard_size``,
    ``zipped=False``), a URL (``gs://...``), or Keras is to ask before overwriting
    (``overwrite=False``)."""
    signature = inspect.signature(original)

    def wrapper(self, filepath, *args, **kwargs):
        if export.multi_rank_strategy(self) is None or not isinstance(filepath,
                                                                      (str, os.PathLike)):
            return original(self, filepath, *args, **kwargs)
        path = os.fspath(filepath)
        options = signature.bind(self, filepath, *args, **kwargs).arguments
        atomic = ("://" not in path and original.__name__ != "export"
                  and not options.get("max_shard_size")
                  and options.get("zipped") is not False
                  and (options.get("overwrite", True) or not os.path.exists(path)))
        export.save_on_chief(self, lambda target: original(self, target, *args, **kwargs),
                             path, f"{original.__name__} {path}", atomic)
    return wrapper


def _tracked_model(checkpoint):
    """The first Keras model ``checkpoint`` (a ``tf.train.Checkpoint``) tracks directly that
    was created under a multi-process PoseidonStrategy, else None."""
    return next((value for value in getattr(checkpoint, "_kwargs", {}).values()
                 if isinstance(value, keras_model.Model) and export.multi_rank_strategy(value)),
                None)


def _checkpoint_written_by_rank0(original):
    """``tf.train.Checkpoint._write``, through which its ``write`` and ``save`` and
    ``tf.train.CheckpointManager.save`` write, for a checkpoint of a model under a
    multi-process PoseidonStrategy: every rank calls it (collective, blocking); rank 0 writes
    from the consistent state (export.save_on_chief), with the write's callbacks (the
    ``checkpoint`` state file, the manager's deletion of old checkpoints), and once it is done
    every other rank runs the callbacks without their files (:func:`_files_left_to_rank0`),
    so that ``latest_checkpoint`` is the same on every rank."""
    def wrapper(self, file_prefix, options=None):
        model = _tracked_model(self)
        if (model is None or not isinstance(file_prefix, (str, os.PathLike))
                or (options is not None and options.experimental_enable_async_checkpoint)):
            return original(self, file_prefix, options)  # asynchronous: refused (below)
        path = os.fspath(file_prefix)
        export.save_on_chief(model, lambda _: original(self, path, options), path,
                             f"write the checkpoint {path}", atomic=False)
        if world.rank() != 0:
            with _files_left_to_rank0():
                tf_checkpoint._execute_callbacks(  # pylint: disable=protected-access
                    (options and options.experimental_write_callbacks) or [], path)
        return path
    return wrapper


@contextlib.contextmanager
def _files_left_to_rank0():
    """Within it, TensorFlow's checkpoint bookkeeping (``update_checkpoint_state_internal``:
    the ``checkpoint`` state file; ``_delete_file_if_exists``: a manager's old checkpoints)
    touches no file: a checkpoint's write callbacks update only the Python state of its
    manager, as rank 0's did along with the files."""
    # pylint: disable=protected-access
    kept = (tf_checkpoint_management.update_checkpoint_state_internal,
            tf_checkpoint_management._delete_file_if_exists)
    tf_checkpoint_management.update_checkpoint_state_internal = lambda *_, **__: None
    tf_checkpoint_management._delete_file_if_exists = lambda *_: None
    try:
        yield
    finally:
        (tf_checkpoint_management.update_checkpoint_state_internal,
         tf_checkpoint_management._delete_file_if_exists) = kept


def _saved_model_written_by_rank0(original):
    """``tf.saved_model.save(obj, export_dir, ...)`` of a Keras model created under a
    multi-process PoseidonStrategy: every rank calls it (collective, blocking), rank 0 writes
    from the consistent state, into ``export_dir`` itself (export.save_on_chief), and every
    rank returns once it is written. Its variables go through the temporary files of fixed
    names that ``tf.train.Checkpoint`` writes through (:func:`_checkpoint_written_by_rank0`)."""
    def wrapper(obj, export_dir, *args, **kwargs):
        if (not isinstance(obj, keras_model.Model) or export.multi_rank_strategy(obj) is None
                or not isinstance(export_dir, (str, os.PathLike))):
            return original(obj, export_dir, *args, **kwargs)
        path = os.fspath(export_dir)
        export.save_on_chief(obj, lambda _: original(obj, path, *args, **kwargs), path,
                             f"write the SavedModel {path}", atomic=False)
    return wrapper


def _no_asynchronous_checkpoint(original):
    def wrapper(self):
        if _tracked_model(self) is not None:
            raise ValueError(
                "tf_poseidon: asynchronous checkpoints (tf.train.CheckpointOptions("
                "experimental_enable_async_checkpoint=True)) of a model under a multi-process "
                "PoseidonStrategy are not supported: rank 0 writes every checkpoint while the "
                "other ranks wait, which a write from a background thread would do out of order "
                "with the ranks' collectives. Leave the option off (docs/checkpoints.md).")
        return original(self)
    return wrapper


def _in_consistent_state(original):
    def wrapper(self, *args, **kwargs):
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None:
            return original(self, *args, **kwargs)
        with extended.consistent_state():
            return original(self, *args, **kwargs)
    return wrapper


def _on_global_batch(original):
    """``train_on_batch``, ``test_on_batch`` and ``predict_on_batch``: the batch is the global
    batch, the same on every rank (checked, in a lockstep algorithm: one small all-gather), and
    each rank runs its rows of it (data.slice_for_rank), as ``fit`` runs its share of every
    batch."""
    signature = inspect.signature(original)

    def wrapper(self, *args, **kwargs):
        extended = _poseidon_extended(getattr(self, "distribute_strategy", None))
        if extended is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        names = [name for name in ("x", "y", "sample_weight") if name in bound.arguments]
        batch = data_lib.global_batch_tensors([bound.arguments[name] for name in names])
        if extended.config.algorithm.lockstep:
            engine = extended.engine
            data_lib.check_same_batch(
                original.__name__, data_lib.describe_batch(batch),
                lambda d: engine.call(lambda comm: comm.allgather(d), label="the batch"))
        rows = data_lib.slice_for_rank(batch, extended._world.rank, extended._world.size)
        bound.arguments.update(zip(names, rows))
        if original.__name__ != "test_on_batch" or extended.config.algorithm.lockstep:
            return original(*bound.args, **bound.kwargs)
        # Not in lockstep, a step's metrics are the rank's own (_get_metrics_result); combined
        # after the step, they are the whole batch's, as evaluate's are.
        return_dict, bound.arguments["return_dict"] = bound.arguments.get("return_dict"), True
        original(*bound.args, **bound.kwargs)
        logs = keras_python_utils.pythonify_logs(self.get_metrics_result())
        return logs if return_dict else self._flatten_metrics_in_order(logs)
    return wrapper


class _MetricReduction(threading.local):
    """Whether this thread is computing metric results from state already summed over ranks
    (inside :func:`_global_results`), where ``result()`` must read that state as it is."""

    active = False


_metric_reduction = _MetricReduction()


def _global_results(extended, metrics) -> list:
    """Each metric's result computed from its state variables combined over ranks as each
    variable's ``aggregation`` says, as TensorFlow's strategies read a metric's on-read
    variables: "sum" (every Keras metric's) the sum, "mean" the mean, "only_first_replica"
    rank 0's value; one collective for all of them. Every rank calls it alike (graph or
    eager). Raises ValueError, before any communication, for a variable whose aggregation is
    "none": ranks have no way to combine it."""
    for m in metrics:
        for v in m.variables:
            if v.aggregation not in _COMBINE_METRIC_STATE:
                raise ValueError(
                    f"tf_poseidon: metric {_metric_holding(m, v).name!r} keeps its state in "
                    f"variable {v.name!r} with aggregation={v.aggregation!r}, which does not "
                    "say how to combine the ranks' values. Create it with "
                    "add_variable(..., aggregation='sum') (a count or total), 'mean' or "
                    "'only_first_replica'.")
    variables = [v for m in metrics for v in m.variables]
    rank, size = extended._world.rank, extended._world.size
    summed = iter(extended.sum_over_ranks(
        [v.value if v.aggregation != "only_first_replica" or rank == 0
         else tf.zeros_like(v.value) for v in variables], "metrics"))
    outer, _metric_reduction.active = _metric_reduction.active, True
    try:
        return [m.stateless_result([_COMBINE_METRIC_STATE[v.aggregation](next(summed), size)
                                    for v in m.variables]) if m.variables else m.result()
                for m in metrics]
    finally:
        _metric_reduction.active = outer


def _metric_holding(metric, variable):
    """The innermost metric within ``metric`` (itself included: Keras' CompileMetrics holds
    the user's metrics) whose state includes ``variable``."""
    for inner in metric._metrics:
        if any(variable is v for v in inner.variables):
            return _metric_holding(inner, variable)
    return metric


_COMBINE_METRIC_STATE = {
    "sum": lambda total, size: total,
    "mean": lambda total, size: (total / size if total.dtype.is_floating else total // size),
    "only_first_replica": lambda total, size: total,  # the other ranks sent zeros
}
"""A metric state variable's ``aggregation`` -> its value over ranks from the sum over ranks
(rank 0's own value alone for "only_first_replica") and the number of ranks."""


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
        results = {}
        for metric, value in zip(metrics, _global_results(extended, metrics)):
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        return results
    return wrapper


@contextlib.contextmanager
def _global_metric_results(model, extended):
    """Within it, ``result()`` of each metric of ``model.metrics`` is computed from the sum over
    ranks of its state (instance attributes shadowing the method, removed on exit)."""
    if not extended.config.algorithm.lockstep:
        yield
        return
    metrics = list({id(m): m for m in model.metrics}.values())

    def reducing(metric, local_result):
        @tf.autograph.experimental.do_not_convert
        def result():
            if _metric_reduction.active:
                return local_result()
            return _global_results(extended, [metric])[0]
        return result

    for metric in metrics:
        metric.result = reducing(metric, metric.result)
    try:
        yield
    finally:
        for metric in metrics:
            del metric.result


def _make_function(original):
    def wrapper(self, step_function):
        extended = _poseidon_extended(self.distribute_strategy)
        if extended is None:
            return original(self, step_function)
        compile_step = _compiles(self)
        if compile_step:
            _refuse_xla_in_16_bits(self, extended._num_replicas_in_sync)
        training = step_function == self.train_step  # make_train_function's step

        def step(data):
            rows = data_lib.batch_size_of(data)
            with _global_metric_results(self, extended), _means_of_rows_only(self, rows), \
                    tf.distribute.get_replica_context().drawing_by_rows(
                        _draw_window(self, extended, rows)), \
                    (tf.xla.experimental.jit_scope() if compile_step
                     else contextlib.nullcontext()):
                logs = step_function(data)
                if training:
                    extended.synchronize_state(self, rows)
                return logs

        if not compile_step:
            return original(self, step)
        # Keras would wrap the whole step in tf.function(jit_compile=True).
        outer, self._jit_compile = self._jit_compile, False
        try:
            return original(self, step)
        finally:
            self._jit_compile = outer
    return wrapper


def _compiles(model) -> bool:
    """Whether ``model``'s steps are compiled with XLA (``compile(jit_compile=True)``)."""
    return bool(model.jit_compile) and not model.run_eagerly


def _refuse_xla_in_16_bits(model, ranks: int) -> None:
    """Raises ValueError naming ``jit_compile`` if a layer of ``model`` computes in float16 or
    bfloat16 (module docstring: XLA)."""
    low = sorted({layer.compute_dtype for layer in model._flatten_layers()
                  if layer.compute_dtype in ("float16", "bfloat16")})
    if low:
        raise ValueError(
            f"tf_poseidon: compile(jit_compile=True) is not supported with {'/'.join(low)} "
            f"compute (mixed precision) on {ranks} "
            "ranks: XLA would compile the step in clusters around the communication, which "
            "round 16-bit values at other places than one process's compiled step, so the "
            "ranks would not train like one process. Compile with jit_compile=False, or keep "
            "jit_compile=True with the float32 policy.")


def _reduce_per_replica(original):
    def wrapper(values, strategy, reduction):
        extended = _poseidon_extended(strategy)
        if extended is not None and reduction == "concat":
            return tree.map_structure(lambda v: extended.gather_along(v, 0), values)
        return original(values, strategy, reduction)
    return wrapper


def _epoch_iterator(original):
    def wrapper(self, distribute_strategy=None, *args, **kwargs):
        extended = _poseidon_extended(distribute_strategy)
        if extended is None:
            return original(self, distribute_strategy, *args, **kwargs)
        # Keras' TFEpochIterator.__init__, checking the input with what its adapter knows (the
        # sizes of arrays' batches, a PyDataset's order) instead of the strategy's check of
        # the dataset the adapter makes of it.
        keras_epoch_iterator.EpochIterator.__init__(self, *args, **kwargs)
        self._distribute_strategy = distribute_strategy
        adapter = self.data_adapter
        dataset = adapter.get_tf_dataset()
        extended.check_input(data_lib.describe_input(adapter), data_lib.cache_files(dataset)
                             if isinstance(dataset, tf.data.Dataset) else [])
        if (isinstance(adapter, py_dataset_adapter.PyDatasetAdapter)
                and adapter.py_dataset.num_batches is not None):
            _agree_on_batch_order(adapter, extended.engine)
        self._distributed_dataset = (
            dataset if isinstance(dataset, tf.distribute.DistributedDataset)
            else extended.slices_of_global_batches(dataset))
    return wrapper


def _agree_on_batch_order(adapter, engine) -> None:
    """A finite PyDataset's batches in the same order on every rank (module docstring):
    collective (once, now) if the adapter shuffles."""
    enqueuer = adapter.enqueuer
    if enqueuer is not None:
        enqueuer.tf_poseidon_passes = True
    if not adapter.shuffle:
        return
    generator = data_lib.agreed_python_random(_broadcast_from_rank0(engine))
    ordered = data_lib.AgreedBatchOrder(adapter.py_dataset, generator)
    adapter.shuffle, adapter.py_dataset = False, ordered
    if enqueuer is not None:
        enqueuer.shuffle, enqueuer.py_dataset = False, ordered


def _broadcast_from_rank0(engine):
    """``broadcast_from_rank0(value) -> rank 0's value`` over ``engine``, as data.py's
    agreements on a shuffle take it (a collective on every rank)."""
    return lambda value: engine.call(lambda comm: comm.bcast(value, root=0))


def _begin_pass(original):
    """For a PyDatasetAdapter's finite generator and an OrderedEnqueuer's run: each starts a
    pass over the batches, so an AgreedBatchOrder draws the pass's order first."""
    def wrapper(self, *args, **kwargs):
        if isinstance(self.py_dataset, data_lib.AgreedBatchOrder):
            self.py_dataset.begin_pass()
        return original(self, *args, **kwargs)
    return wrapper


def _end_pass(original):
    """For an OrderedEnqueuer's stop: Keras keeps the batches fetched but not taken for its
    next run, which for a finite PyDataset starts a new pass from its first batch, so they
    would be served again, out of turn (Keras' model build under a strategy takes one batch
    and stops the enqueuer: under PoseidonStrategy only for an input whose shapes tf.data does
    not fully know, see _symbolic_build_from_spec). A finite pass of a multi-rank fit drops
    them."""
    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "tf_poseidon_passes", False):
            while True:
                try:
                    self.ready_queue.get_nowait()
                except queue.Empty:
                    break
    return wrapper


def _symbolic_build_from_spec(original):
    def wrapper(self, iterator=None, data_batch=None):
        if not isinstance(self._distribute_strategy, _strategy_class):
            return original(self, iterator=iterator, data_batch=data_batch)
        if type(self).call is keras_model.Model.call:
            return None  # no call(): only a train_step (a GAN), built as it is traced
        if iterator is None:
            return original(self, data_batch=data_batch)
        spec = iterator._distributed_dataset.element_spec  # the module docstring says why
        if all(_known_but_the_batch(s) for s in tf.nest.flatten(spec) if s is not None):
            return original(self, data_batch=spec)
        return original(self, iterator=iterator)
    return wrapper


def _known_but_the_batch(spec) -> bool:
    """Whether the type spec ``spec`` knows every dimension of its tensors but the first."""
    shape = getattr(spec, "shape", None)
    return shape is not None and shape.rank is not None and shape[1:].is_fully_defined()


def _epoch_dataset(original):
    def wrapper(self):
        extended = _poseidon_extended(self._distribute_strategy)
        adapter = self.data_adapter
        if (extended is None or not isinstance(adapter, array_data_adapter.ArrayDataAdapter)
                or not adapter._shuffle):
            return original(self)
        seeds = self.__dict__.get("_tp_epoch_seeds")
        if seeds is None:
            seeds = self._tp_epoch_seeds = data_lib.agreed_permutation_seeds(
                _broadcast_from_rank0(extended.engine))
        with data_lib.tracing_seed(next(seeds)):
            dataset = adapter.get_tf_dataset()
        return extended.slices_of_global_batches(dataset)
    return wrapper


def install(strategy_class: type) -> None:
    """Installs the wrappers described in the module docstring (once); they act for
    ``strategy_class`` (PoseidonStrategy) with more than one rank, or of any size where the
    module docstring says so."""
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
    _wrap(keras_tf_trainer.TensorFlowTrainer, "train_step", _by_batch_share)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "test_step", _by_batch_share)
    _wrap(keras_loss, "reduce_weighted_values", _reduce_weighted_values)
    _wrap(keras_tf_random, "dropout", _drawn(_dropout_by_rows))
    _wrap(keras_tf_random, "uniform", _drawn(_uniform_by_rows))
    _wrap(keras_tf_random, "normal", _drawn(_normal_by_rows))
    _wrap(keras_tf_random, "randint", _drawn(_randint_by_rows))
    _wrap(keras_batch_normalization.BatchNormalization, "_moments", _batchnorm_moments)
    _wrap(keras_rnn.RNN, "_create_state_variables", _rows_of_rnn_state)
    _wrap(keras_rnn.RNN, "call", _rnn_call)
    _wrap(keras_compile_utils.CompileLoss, "call", _compile_loss_call)
    _wrap(keras_trainer.Trainer, "get_metrics_result", _get_metrics_result)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "fit", _fit)
    for method in ("save", "save_weights", "export"):
        _wrap(keras_model.Model, method, _saved_by_rank0)
    _wrap(tf_checkpoint.Checkpoint, "_write", _checkpoint_written_by_rank0)
    _wrap(tf_checkpoint.Checkpoint, "_async_checkpointer", _no_asynchronous_checkpoint)
    _wrap(tf.saved_model, "save", _saved_model_written_by_rank0)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "evaluate", _in_consistent_state)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "predict", _in_consistent_state)
    for method in ("train_on_batch", "test_on_batch", "predict_on_batch"):
        _wrap(keras_tf_trainer.TensorFlowTrainer, method, _on_global_batch)
    for method in ("test_on_batch", "predict_on_batch"):
        _wrap(keras_tf_trainer.TensorFlowTrainer, method, _in_consistent_state)
    _wrap(keras_tf_trainer, "reduce_per_replica", _reduce_per_replica)
    _wrap(keras_tf_trainer.TFEpochIterator, "__init__", _epoch_iterator)
    _wrap(keras_tf_trainer.TFEpochIterator, "_get_iterator", _epoch_dataset)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _symbolic_build_from_spec)
    _wrap(py_dataset_adapter.PyDatasetAdapter, "_finite_generator", _begin_pass)
    _wrap(py_dataset_adapter.OrderedEnqueuer, "_run", _begin_pass)
    _wrap(py_dataset_adapter.OrderedEnqueuer, "stop", _end_pass)
    _wrap(keras_tf_trainer.TensorFlowTrainer, "_make_function", _make_function)
