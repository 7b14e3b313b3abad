"""Worker for the model zoo test: real Keras models of the families users train, trained with
``fit`` under PoseidonStrategy, with everything the test compares saved on every rank.

    model_zoo.py OUT ENTRY[,ENTRY...]

An entry is MODEL-VARIANT. Models (all Functional, all exported for serving):

  bn_cnn       ResNet-style block (Conv2D + BatchNormalization, a residual Add) on the examples'
               8x8 digits (examples/data/) flipped at random (RandomFlip), SGD with momentum;
               evaluated on held-out digits
  transformer  encoder block: Embedding, MultiHeadAttention (with dropout), LayerNormalization,
               Dense on 3-D inputs, Dropout; SGD with momentum
  rnn          GRU + LSTM sequence classifier, trained with class_weight; GaussianNoise,
               GaussianDropout, SpatialDropout1D and the RNNs' dropout and recurrent_dropout
  tagger       a token tagger over padded sequences of 1 to 12 tokens: Embedding(mask_zero=True),
               LSTM(return_sequences=True), a Dense per token, Adam, so the loss and accuracy
               are masked (a rank's loss is divided by its own count of tokens); a
               sample_weight per token; the last global batch has one row; the small table
               costs fewer bytes summed densely, but Adam applies each row on its own.
               tagger_sum (SGD with momentum): the loss with reduction="sum" (weighted 0.006:
               about a mean's size); tagger_weighted (SGD with momentum):
               reduction="mean_with_sample_weight"
  wide_deep    a wide linear part and a deep part over one large Embedding (sparse gradients,
               ids repeated within every global batch), Adam; wide_deep_sgd the same with plain
               SGD. The last global batch has one row: ranks without rows at P=2 and 3.
               Metrics: accuracy, AUC, Precision, Recall and RankAgnostic (state variables of
               each aggregation)
  mp_cnn       a CNN under the mixed_float16 policy (LossScaleOptimizer); the last global
               batch of 29 rows is split unevenly at P=2 and 3
  mp_mlp       an MLP under the mixed_float16 policy, SGD with momentum; the last global batch
               has one row (ranks without rows)
  mp_cnn_bf16  mp_cnn under the mixed_bfloat16 policy (no loss scale)
  accum        the MLP with Adam(gradient_accumulation_steps=2); the last global batch has one
               row, so a rank's last micro-batch is empty; accum_sgd the same with SGD
  pydataset    the MLP with SGD and momentum fed by a keras.utils.PyDataset of global batches
               (the last of one row: ranks without rows), not by arrays
  two_io       two inputs, two outputs, per-output losses and loss_weights, sample_weight
  stopping     the MLP with Adam on few rows with noisy labels, validated every epoch
               (validation_data, uneven last batches), with ReduceLROnPlateau and
               EarlyStopping(restore_best_weights=True) on val_loss, the metric every rank
               sees
  bn_mlp       Dense + BatchNormalization (Conv2D refuses empty batches), the first BN layer
               ("input_norm") on the input features, SGD with momentum: 65 rows at a global
               batch of 16, so the last batch of every epoch has one row and P-1 ranks none;
               bn_mlp_synced the same built with BatchNormalization(synchronized=True)
  peak_metric  the MLP with a metric whose state variable has aggregation="none" (refused on
               several ranks)

Variants: keras (plain Keras, no strategy; one process only), sync (mode="sync", sfb="auto"),
sbn (sync + sync_batchnorm=True), always (sfb="always"), eager (sync with
compile(run_eagerly=True)), xla and sbnxla (sync and sbn with compile(jit_compile=True)),
sliced2 and sliced3 (one process only: each global batch's gradient summed from the gradients of
the row slices that 2 or 3 ranks take, see sliced_train_step), and, trained for the first 12
steps only, fp16 (compression="fp16"), ssp (mode="ssp", staleness 1) and easgd (mode="easgd",
tau 2, alpha 0.9/P).

Every rank seeds with 1000·rank + a fixed seed, so rank 0 seeds as a single process does and
rank 0's initial values must reach the others, the seed generators' states among them: the
random layers' draws (masks, noise, flips) are then one process's, each rank drawing the rows
of its slice (tf_poseidon/batch_draws.py).

Writes OUT/<entry>_rank<r>.npz: ``trainable``, ``non_trainable`` and ``optimizer`` (the
optimizer's variables; each concatenated, read inside the strategy's consistent_state, as
saving does), ``input_norm_moving_mean`` (models with such a layer), ``<each>_step12`` (the
three after the first 12 steps, where there are as many) and ``non_trainable_local_step12``
(the non-trainable ones then, read before consistent_state: this rank's own),
``loss`` (per epoch), ``evaluation`` and ``initial_evaluation`` (before training; both sorted
by metric name), ``predict_<output>`` (model.predict: every rank's rows, gathered),
``own_<output>`` (this rank's model called on the same inputs in global batches, no
communication), ``plan`` and ``plan_reason`` (P > 1, where the algorithm has a per-layer
plan: per row of strategy.plan(), "<variable> <protocol>" and the reason of the choice),
``repeated_ids`` (wide_deep: per global batch, lookups minus distinct ids), ``val_loss``,
``learning_rates`` and ``best_epoch`` (stopping: per epoch run, and the epoch whose weights
EarlyStopping restored) and, for the sync-mode variants, ``export_<output>`` (the exported
SavedModel's serving signature run on the predict inputs; rank 0, which writes it). An entry
that raises writes OUT/<entry>_rank<r>.error with the traceback instead.
"""

import contextlib
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                os.pardir, "examples"))
import digits as digits_data  # noqa: E402  (examples/digits.py)
from global_batches import GlobalBatches  # noqa: E402

SEED = 17


# -- data (the same on every rank) ----------------------------------------------------------

def digits():
    images, labels = digits_data.load_digits()
    x = (images.reshape(-1, 8, 8, 1) / 16.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], labels[order].astype("int32")
    # 1440 training rows at a global batch of 50: 29 steps per epoch, the last one of 40 rows.
    return {"x": x[:1440], "y": y[:1440], "x_test": x[1440:], "y_test": y[1440:],
            "batch": 50, "epochs": 3}


def token_data():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 40, size=(390, 12)).astype("int32")
    y = np.digitize(x.mean(1), [18.5, 20.5]).astype("int32")
    return {"x": x, "y": y, "x_test": x[:100], "y_test": y[:100], "batch": 32, "epochs": 1}


def sequence_data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(330, 10, 4)).astype("float32")
    y = np.digitize(x[:, :, 0].mean(1), [-0.25, 0.3]).astype("int32")
    return {"x": x, "y": y, "x_test": x[:100], "y_test": y[:100], "batch": 30, "epochs": 1,
            "class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}


def tagged_tokens():
    rng = np.random.default_rng(8)
    n, length = 241, 12
    lengths = rng.integers(1, length + 1, size=n)
    x = rng.integers(1, 60, size=(n, length)).astype("int32")
    x[np.arange(length)[None, :] >= lengths[:, None]] = 0  # padding: masked by the Embedding
    y = (x % 4).astype("int32")
    return {"x": x, "y": y, "x_test": x[:100], "y_test": y[:100], "batch": 24, "epochs": 1,
            "sample_weight": rng.uniform(0.5, 1.5, size=(n, length)).astype("float32")}


def wide_deep_data():
    rng = np.random.default_rng(3)
    # 11 global batches of 32 and one of 1 row; skewed ids: repeats within a batch.
    ids = (rng.zipf(1.3, size=(353, 4)) % 20000).astype("int32")
    y = (ids % 7 < 3).any(1).astype("float32")[:, None]
    repeated = [ids[i:i + 32].size - np.unique(ids[i:i + 32]).size for i in range(0, 353, 32)]
    return {"x": ids, "y": y, "x_test": ids[:100], "y_test": y[:100], "batch": 32, "epochs": 1,
            "saved": {"repeated_ids": np.array(repeated)}}


def image_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(349, 8, 8, 2)).astype("float32")  # the last global batch: 29 rows
    y = (x[..., 0].mean((1, 2)) > 0).astype("int32") + (x[..., 1].mean((1, 2)) > 0.1)
    return {"x": x, "y": y.astype("int32"), "x_test": x[:100], "y_test": y[:100].astype("int32"),
            "batch": 32, "epochs": 1}


def mlp_data():
    rng = np.random.default_rng(5)
    # 9 global batches of 32 and one of 1 row: the last update's second micro-batch leaves a
    # rank without rows.
    x = rng.normal(size=(289, 10)).astype("float32")
    y = (x[:, :3].sum(1) > 0).astype("int32")
    return {"x": x, "y": y, "x_test": x[:100], "y_test": y[:100], "batch": 32, "epochs": 1}


def pydataset_data():
    return mlp_data() | {"pydataset": True}


def stopping_data():
    rng = np.random.default_rng(8)
    # 91 training rows at a global batch of 16 (the last batch of 11 rows), 30% of their labels
    # flipped, so the model soon overfits and val_loss turns; 45 clean validation rows (the
    # last batch of 13).
    x = rng.normal(size=(136, 10)).astype("float32")
    y = (x[:, :3].sum(1) > 0).astype("int32")
    flipped = (rng.uniform(size=136) < 0.3) & (np.arange(136) < 91)
    y = np.where(flipped, 1 - y, y).astype("int32")
    return {"x": x[:91], "y": y[:91], "x_test": x[91:], "y_test": y[91:], "batch": 16,
            "epochs": 40, "callbacks": lambda: [
                keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=1),
                keras.callbacks.EarlyStopping("val_loss", min_delta=1e-3, patience=3,
                                              restore_best_weights=True)]}


def bn_rows():
    rng = np.random.default_rng(7)
    # 65 training rows at a global batch of 16: the last batch of each epoch has one row.
    x = (rng.normal(size=(105, 6)) * [1, 2, 0.5, 1, 3, 1] + [0, 1, -2, 0.5, 0, 4]).astype(
        "float32")
    y = np.digitize(x[:, 0] + 0.5 * x[:, 1] - x[:, 2], [-1.0, 1.5]).astype("int32")
    return {"x": x[:65], "y": y[:65], "x_test": x[65:], "y_test": y[65:], "batch": 16,
            "epochs": 3}


def two_io_data():
    rng = np.random.default_rng(6)
    n = 340
    x = {"image": rng.normal(size=(n, 6, 6, 1)).astype("float32"),
         "meta": rng.normal(size=(n, 5)).astype("float32")}
    y = {"kind": (x["meta"][:, 0] + x["image"].mean((1, 2, 3)) > 0).astype("int32"),
         "size": (x["meta"][:, 1:3].sum(1, keepdims=True) * 0.5).astype("float32")}
    weights = rng.uniform(0.2, 2.0, size=n).astype("float32")
    head = {k: v[:100] for k, v in x.items()}
    return {"x": x, "y": y, "x_test": head, "y_test": {k: v[:100] for k, v in y.items()},
            "batch": 32, "epochs": 1, "sample_weight": weights}


# -- models ---------------------------------------------------------------------------------

def bn_cnn():
    # Swish and average pooling, not ReLU and max pooling: BN puts many values next to 0, where
    # ReLU's and max pooling's choices flip with rounding. With ReLU/max pooling one process
    # itself ends 0.027 away from its own result when only the order of the rows inside each
    # batch changes (2 of 3 random orders, 87 steps), so no P-rank result could be held to
    # 1e-5 of it; with swish/average pooling reordered rows stay within 2e-7.
    def conv_bn(x, activate=True):
        x = keras.layers.Conv2D(12, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        return keras.layers.Activation("swish")(x) if activate else x

    inputs = keras.Input((8, 8, 1), name="image")
    stem = conv_bn(keras.layers.RandomFlip("horizontal")(inputs))
    block = conv_bn(conv_bn(stem), activate=False)
    x = keras.layers.Activation("swish")(keras.layers.Add()([stem, block]))
    x = keras.layers.Flatten()(keras.layers.AveragePooling2D(2)(x))
    model = keras.Model(inputs, keras.layers.Dense(10, name="digit")(x))
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def transformer():
    width = 16
    tokens = keras.Input((12,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(40, width)(tokens)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)(x, x)
    attention = keras.layers.Dropout(0.2)(attention)
    x = keras.layers.LayerNormalization()(x + attention)
    hidden = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(3, name="label")(x))
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def rnn():
    inputs = keras.Input((10, 4), name="sequence")
    x = keras.layers.GaussianNoise(0.1)(inputs)
    x = keras.layers.GRU(12, return_sequences=True, dropout=0.1, recurrent_dropout=0.1)(x)
    x = keras.layers.SpatialDropout1D(0.1)(x)
    x = keras.layers.LSTM(8, dropout=0.1)(keras.layers.GaussianDropout(0.1)(x))
    model = keras.Model(inputs, keras.layers.Dense(3, name="label")(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def tagger(reduction: str = "sum_over_batch_size", loss_weight: float = 1.0, optimizer=None):
    tokens = keras.Input((12,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(60, 8, mask_zero=True)(tokens)
    x = keras.layers.LSTM(8, return_sequences=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="tag")(x))
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.5, momentum=0.9),
                  loss_weights=[loss_weight],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction=reduction),
                  metrics=["accuracy"])
    return model


class RankAgnostic(keras.metrics.Metric):
    """A metric with a state variable of each aggregation, each holding what one process would
    hold once the ranks' values are combined that way: ``rows`` (sum) the rows seen, ``last``
    (mean) a value every rank sets alike, ``first`` (only_first_replica) a value only rank 0
    sets as one process does."""

    def __init__(self, name="rank_agnostic", **kwargs):
        super().__init__(name=name, **kwargs)
        self.rows = self.add_variable((), "zeros", aggregation="sum", name="rows")
        self.last = self.add_variable((), "zeros", aggregation="mean", name="last")
        self.first = self.add_variable((), "zeros", aggregation="only_first_replica",
                                       name="first")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.rows.assign_add(tf.cast(tf.shape(y_true)[0], self.dtype))
        self.last.assign(3.0)
        self.first.assign(7.0 + 100.0 * tp.rank())

    def result(self):
        return {name: keras.ops.cast(variable, self.dtype) for name, variable in
                [("rows_seen", self.rows), ("mean_of_ranks", self.last), ("rank_0", self.first)]}


def wide_deep(optimizer=None):
    ids = keras.Input((4,), dtype="int32", name="ids")
    wide = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20000, 1)(ids))
    deep = keras.layers.Flatten()(keras.layers.Embedding(20000, 16)(ids))
    deep = keras.layers.Dense(16, activation="relu")(deep)
    logit = keras.layers.Add()([wide, keras.layers.Dense(1)(deep)])
    model = keras.Model(ids, keras.layers.Activation("sigmoid", name="click")(logit))
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                  loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"),
                           keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall"), RankAgnostic()])
    return model


def classifier(inputs, logits, optimizer) -> keras.Model:
    """``inputs`` -> ``logits`` (float32 whatever the policy) compiled with ``optimizer`` and
    sparse categorical cross-entropy."""
    outputs = keras.layers.Activation("linear", dtype="float32", name="label")(logits)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def cnn():
    inputs = keras.Input((8, 8, 2), name="image")
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.Flatten()(x)
    return classifier(inputs, keras.layers.Dense(3)(x),
                      keras.optimizers.SGD(0.05, momentum=0.9))


def mlp(optimizer):
    inputs = keras.Input((10,), name="features")
    x = keras.layers.Dense(16, activation="tanh")(inputs)
    return classifier(inputs, keras.layers.Dense(2)(x), optimizer)


class Peak(keras.metrics.Metric):
    """The largest logit seen, kept in a variable with aggregation="none": no way to combine
    the ranks' values, so refused on several ranks."""

    def __init__(self):
        super().__init__(name="peak")
        self.peak = self.add_variable((), "zeros", aggregation="none", name="peak_value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.peak.assign(keras.ops.maximum(self.peak, keras.ops.max(y_pred)))

    def result(self):
        return keras.ops.cast(self.peak, self.dtype)


def peak_metric():
    model = mlp(keras.optimizers.SGD(0.1))
    model.compile(optimizer=model.optimizer, loss=model.loss, metrics=[Peak()])
    return model


def mixed_precision(build, policy: str = "mixed_float16"):
    """``build`` under ``policy`` (restored to float32 after); mixed_float16 wraps the
    optimizer in a LossScaleOptimizer, mixed_bfloat16 does not."""
    def built():
        keras.mixed_precision.set_global_policy(policy)
        try:
            model = build()
        finally:
            keras.mixed_precision.set_global_policy("float32")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (
            policy == "mixed_float16")
        return model
    return built


def bn_mlp(synchronized: bool = False):
    def norm(name=None):
        return keras.layers.BatchNormalization(momentum=0.8, synchronized=synchronized,
                                               name=name)

    inputs = keras.Input((6,), name="features")
    x = norm("input_norm")(inputs)  # depends on the data only: its moving mean is exact
    x = keras.layers.Dense(16, use_bias=False)(x)
    x = keras.layers.Activation("swish")(norm()(x))
    return classifier(inputs, keras.layers.Dense(3)(x),
                      keras.optimizers.SGD(0.05, momentum=0.9))


def two_io():
    image = keras.Input((6, 6, 1), name="image")
    meta = keras.Input((5,), name="meta")
    x = keras.layers.Flatten()(keras.layers.Conv2D(4, 3, activation="relu")(image))
    x = keras.layers.Concatenate()([x, meta])
    x = keras.layers.Dense(16, activation="relu")(x)
    outputs = {"kind": keras.layers.Dense(2, name="kind")(x),
               "size": keras.layers.Dense(1, name="size")(x)}
    model = keras.Model({"image": image, "meta": meta}, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "size": "mse"},
                  loss_weights={"kind": 1.0, "size": 0.5})
    return model


MODELS = {"bn_cnn": (bn_cnn, digits), "transformer": (transformer, token_data),
          "rnn": (rnn, sequence_data),
          "tagger": (lambda: tagger(optimizer=keras.optimizers.Adam(0.01)), tagged_tokens),
          "tagger_sum": (lambda: tagger("sum", loss_weight=0.006), tagged_tokens),
          "tagger_weighted": (lambda: tagger("mean_with_sample_weight"), tagged_tokens),
          "wide_deep": (wide_deep, wide_deep_data),
          "wide_deep_sgd": (lambda: wide_deep(keras.optimizers.SGD(0.5)), wide_deep_data),
          "mp_cnn": (mixed_precision(cnn), image_data),
          "mp_mlp": (mixed_precision(lambda: mlp(keras.optimizers.SGD(0.05, momentum=0.9))),
                     mlp_data),
          "mp_cnn_bf16": (mixed_precision(cnn, "mixed_bfloat16"), image_data),
          "accum": (lambda: mlp(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)),
                    mlp_data),
          "accum_sgd": (lambda: mlp(keras.optimizers.SGD(0.1, momentum=0.9,
                                                         gradient_accumulation_steps=2)),
                        mlp_data),
          "stopping": (lambda: mlp(keras.optimizers.Adam(0.01)), stopping_data),
          "pydataset": (lambda: mlp(keras.optimizers.SGD(0.1, momentum=0.9)), pydataset_data),
          "two_io": (two_io, two_io_data), "bn_mlp": (bn_mlp, bn_rows),
          "bn_mlp_synced": (lambda: bn_mlp(synchronized=True), bn_rows),
          "peak_metric": (peak_metric, mlp_data)}


SHORT = ("fp16", "ssp", "easgd")
SHORT_STEPS = 12
JIT = ("xla", "sbnxla")
SLICED = ("sliced2", "sliced3")
EXPORTED = ("sync", "sbn", "always", "eager") + JIT + SLICED


def strategy_for(variant: str) -> tf.distribute.Strategy:
    if variant == "keras":
        assert tp.size() == 1, "plain Keras is the one-process reference"
        return tf.distribute.get_strategy()
    options = {"sync": {}, "sliced2": {}, "sliced3": {}, "sbn": {"sync_batchnorm": True},
               "always": {"sfb": "always"}, "eager": {}, "xla": {},
               "sbnxla": {"sync_batchnorm": True},
               "fp16": {"compression": "fp16"}, "ssp": {"mode": "ssp", "staleness": 1},
               "easgd": {"mode": "easgd", "tau": 2, "alpha": 0.9 / tp.size()}}[variant]
    # sync_batchnorm is passed only where asked for, so the other entries run without it.
    return tp.PoseidonStrategy(**options)


# -- one entry ------------------------------------------------------------------------------

def as_dict(outputs, names) -> dict:
    if isinstance(outputs, dict):
        return {k: np.asarray(v) for k, v in outputs.items()}
    return {names[0]: np.asarray(outputs)}


def exported_outputs(model, export_dir: str, inputs) -> dict:
    """Exports ``model`` (every rank; rank 0 writes) and, on rank 0, runs the SavedModel's
    serving signature on ``inputs``."""
    path = tp.export_for_serving(model, export_dir)
    if not tp.is_chief():
        return {}
    serve = tf.saved_model.load(path).signatures["serving_default"]
    named = inputs if isinstance(inputs, dict) else {model.inputs[0].name: inputs}
    return {k: v.numpy() for k, v in serve(**{k: tf.constant(v) for k, v in named.items()})
            .items()}


def own_outputs(model, inputs, batch: int, names) -> dict:
    """``model`` called on ``inputs`` in batches of ``batch`` rows, in a tf.function, as one
    process's predict calls it (float16 kernels round differently eagerly), on this rank
    alone: no communication."""
    call = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
    rows = len(tf.nest.flatten(inputs)[0])
    parts = [as_dict(call(tf.nest.map_structure(lambda a: a[start:start + batch], inputs)),
                     names)
             for start in range(0, rows, batch)]
    return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


def sliced_train_step(model, slices: int):
    """A train step for ``model`` in one process that computes each global batch's gradient as
    ``slices`` ranks do: the sum over the row slices [⌊n·p/P⌋, ⌊n·(p+1)/P⌋) (P = ``slices``)
    of the gradient of the slice's loss (Keras' compiled loss, a mean over the slice, divided
    by P as Keras divides it under a strategy of P replicas, times the loss scale), each
    weighted by P times the slice's share of the batch. In float32 that is one process's
    gradient up to summation order; under mixed precision each slice's weight gradients are
    rounded to float16 on their own, as they are on each rank. Sample weights: not used;
    History's loss: not recorded."""
    def train_step(data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        n = tf.shape(x)[0]
        total = None
        for p in range(slices):
            start, end = n * p // slices, n * (p + 1) // slices
            with tf.GradientTape() as tape:
                loss = model.compute_loss(y=y[start:end],
                                          y_pred=model(x[start:end], training=True))
                scaled = model.optimizer.scale_loss(loss / slices)
            share = tf.cast(slices * (end - start), tf.float32) / tf.cast(n, tf.float32)
            grads = [tf.math.multiply_no_nan(g, share)
                     for g in tape.gradient(scaled, model.trainable_variables)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        model.optimizer.apply(total, model.trainable_variables)
        return model.compute_metrics(x, y, model(x, training=False), sample_weight=None)
    return train_step


def concatenated(variables) -> np.ndarray:
    return np.concatenate([v.numpy().ravel().astype("float64") for v in variables] or [[]])


def weights_of(model, strategy) -> dict:
    """``trainable``, ``non_trainable`` and ``optimizer`` values, each concatenated, read inside
    the strategy's consistent_state (what saving and exporting read)."""
    with getattr(strategy.extended, "consistent_state", contextlib.nullcontext)():
        return {"trainable": concatenated(model.trainable_weights),
                "non_trainable": concatenated(model.non_trainable_weights),
                "optimizer": concatenated(model.optimizer.variables)}


class Snapshot(keras.callbacks.Callback):
    """After the first SHORT_STEPS steps: this rank's own non-trainable values
    (``local_non_trainable``), then the weights every rank agrees on (``weights``)."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.epoch = strategy, 0
        self.weights = self.local_non_trainable = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == SHORT_STEPS - 1:
            self.local_non_trainable = concatenated(self.model.non_trainable_weights)
            self.weights = weights_of(self.model, self.strategy)


class LearningRates(keras.callbacks.Callback):
    """The learning rate each epoch trained with, read at its end before the callbacks listed
    after this one (ReduceLROnPlateau lowers it there for the next epoch)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def plan_of(strategy) -> dict:
    """strategy.plan()'s rows, each as text; {} where it has none (no per-layer choice)."""
    plan = strategy.plan()
    if not plan.rows:
        return {}
    return {"plan": np.array([f"{row.kernel} {row.choice}" for row in plan.rows]),
            "plan_reason": np.array([row.reason for row in plan.rows])}


def run(entry: str, out: str) -> None:
    name, variant = entry.split("-")
    build, make_data = MODELS[name]
    data = make_data()
    schedule = ({"epochs": 1, "steps_per_epoch": SHORT_STEPS} if variant in SHORT
                else {"epochs": data["epochs"]})
    keras.utils.set_random_seed(SEED + 1000 * tp.rank())
    strategy = strategy_for(variant)
    with strategy.scope():
        model = build()
    if variant in JIT:
        model.jit_compile = True  # what compile(jit_compile=True) sets
    if variant == "eager":
        model.run_eagerly = True  # what compile(run_eagerly=True) sets
    if variant in SLICED:
        assert tp.size() == 1, "a one-process reference"
        model.train_step = sliced_train_step(model, int(variant[len("sliced"):]))
    fit_args = {k: data[k] for k in ("class_weight", "sample_weight") if k in data}
    initial = model.evaluate(data["x_test"], data["y_test"], batch_size=data["batch"],
                             verbose=0, return_dict=True)
    snapshot, rates = Snapshot(strategy), LearningRates()
    extra = data["callbacks"]() if "callbacks" in data else []
    if extra:
        fit_args["validation_data"] = (data["x_test"], data["y_test"])
    inputs = ({"x": GlobalBatches(data["x"], data["y"], data["batch"])}
              if data.get("pydataset") else
              {"x": data["x"], "y": data["y"], "batch_size": data["batch"]})
    history = model.fit(**inputs, shuffle=False, verbose=0,
                        callbacks=[snapshot, rates, *extra], **schedule, **fit_args)
    evaluation = model.evaluate(data["x_test"], data["y_test"], batch_size=data["batch"],
                                verbose=0, return_dict=True)
    output_names = list(model.output_names)
    predictions = as_dict(model.predict(data["x_test"], batch_size=data["batch"], verbose=0),
                          output_names)
    own = own_outputs(model, data["x_test"], data["batch"], output_names)
    saved = dict(weights_of(model, strategy), **data.get("saved", {}),
                 loss=history.history["loss"],
                 evaluation=[evaluation[k] for k in sorted(evaluation)],
                 initial_evaluation=[initial[k] for k in sorted(initial)])
    if extra:
        stopping = next(c for c in extra if isinstance(c, keras.callbacks.EarlyStopping))
        saved.update(val_loss=history.history["val_loss"], learning_rates=rates.rates,
                     best_epoch=stopping.best_epoch)
    if any(layer.name == "input_norm" for layer in model.layers):
        saved["input_norm_moving_mean"] = model.get_layer("input_norm").moving_mean.numpy()
    if snapshot.weights is not None:  # trained for at least SHORT_STEPS steps
        saved.update({f"{k}_step12": v for k, v in snapshot.weights.items()},
                     non_trainable_local_step12=snapshot.local_non_trainable)
    saved.update({f"predict_{k}": v for k, v in predictions.items()})
    saved.update({f"own_{k}": v for k, v in own.items()})
    if tp.size() > 1:
        saved.update(plan_of(strategy))
    if variant in EXPORTED:
        export_dir = os.path.join(out, f"{entry}_export")
        saved.update({f"export_{k}": v for k, v in
                      exported_outputs(model, export_dir, data["x_test"]).items()})
    np.savez(os.path.join(out, f"{entry}_rank{tp.rank()}.npz"), **saved)


def main(out: str, entries: str) -> None:
    for entry in entries.split(","):
        try:
            run(entry, out)
        except Exception:  # recorded for the test; every rank fails alike at these points
            with open(os.path.join(out, f"{entry}_rank{tp.rank()}.error"), "w") as f:
                f.write(traceback.format_exc())
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
