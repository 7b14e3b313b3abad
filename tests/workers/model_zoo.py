"""Worker for the model zoo test: real Keras models of the families users train, trained with
``fit`` under PoseidonStrategy, with everything the test compares saved on every rank.

    model_zoo.py OUT ENTRY[,ENTRY...]

An entry is MODEL-VARIANT. Models (all Functional, all exported for serving):

  bn_cnn       ResNet-style block (Conv2D + BatchNormalization, a residual Add) on the examples'
               8x8 digits (examples/data/), SGD with momentum; evaluated on held-out digits
  transformer  encoder block: Embedding, MultiHeadAttention, LayerNormalization, Dense on 3-D
               inputs, Dropout; SGD with momentum
  rnn          GRU + LSTM sequence classifier, trained with class_weight
  wide_deep    a wide linear part and a deep part over one large Embedding (sparse gradients),
               Adam; wide_deep_sgd the same with plain SGD
  mp_cnn       a CNN under the mixed_float16 policy (LossScaleOptimizer)
  accum        an MLP with gradient_accumulation_steps=2; the last global batch has one row,
               so a rank's last micro-batch is empty
  two_io       two inputs, two outputs, per-output losses and loss_weights, sample_weight

Variants: sync (mode="sync", sfb="auto"), sbn (sync + sync_batchnorm=True), always
(sfb="always"), reordered (sync, rows reversed within every global batch: the same training
up to summation order, which shows how closely one process reproduces itself), and, trained
for the first 12 steps only, fp16 (compression="fp16"), ssp (mode="ssp", staleness 1) and
easgd (mode="easgd", tau 2, alpha 0.9/P).

Every rank seeds with 1000·rank + a fixed seed, so rank 0 seeds as a single process does and
rank 0's initial values must reach the others. The Transformer's Dropout draws one mask for all
rows of a batch (noise_shape (1, 1, d)): its shape does not depend on how many rows a rank
has, so with rank 0's seed generator state every rank and one process drop the same units.

Writes OUT/<entry>_rank<r>.npz: ``trainable``, ``non_trainable`` (concatenated, read inside
the strategy's consistent_state), ``trainable_step12`` and ``non_trainable_step12`` (the same
after the first 12 steps, where there are as many), ``loss`` (per epoch), ``evaluation`` and
``initial_evaluation`` (before training; both sorted by metric name), ``predict_<output>``,
``plan`` (sync variant, P > 1: "<variable> <protocol>" per row of strategy.plan()) and, for
the sync-mode variants, ``export_<output>``
(the exported SavedModel's serving signature run on the predict inputs; rank 0, which writes
it). An entry that raises writes OUT/<entry>_rank<r>.error with the traceback instead.
"""

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


def wide_deep_data():
    rng = np.random.default_rng(3)
    ids = rng.zipf(1.3, size=(352, 4)) % 20000  # skewed ids: repeats within a batch
    y = (ids % 7 < 3).any(1).astype("float32")[:, None]
    return {"x": ids.astype("int32"), "y": y, "x_test": ids[:100].astype("int32"),
            "y_test": y[:100], "batch": 32, "epochs": 1}


def image_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(352, 8, 8, 2)).astype("float32")
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
    stem = conv_bn(inputs)
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
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    attention = keras.layers.Dropout(0.2, noise_shape=(1, 1, width))(attention)
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
    x = keras.layers.GRU(12, return_sequences=True)(inputs)
    x = keras.layers.LSTM(8)(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="label")(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def wide_deep(optimizer=None):
    ids = keras.Input((4,), dtype="int32", name="ids")
    wide = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20000, 1)(ids))
    deep = keras.layers.Flatten()(keras.layers.Embedding(20000, 16)(ids))
    deep = keras.layers.Dense(16, activation="relu")(deep)
    logit = keras.layers.Add()([wide, keras.layers.Dense(1)(deep)])
    model = keras.Model(ids, keras.layers.Activation("sigmoid", name="click")(logit))
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                  loss="binary_crossentropy", metrics=["accuracy"])
    return model


def mp_cnn():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((8, 8, 2), name="image")
        x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
        x = keras.layers.Conv2D(8, 3, activation="relu")(x)
        x = keras.layers.Flatten()(x)
        logits = keras.layers.Dense(3)(x)
        outputs = keras.layers.Activation("linear", dtype="float32", name="label")(logits)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    return model


def accum():
    inputs = keras.Input((10,), name="features")
    x = keras.layers.Dense(16, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="label")(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


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
          "rnn": (rnn, sequence_data), "wide_deep": (wide_deep, wide_deep_data),
          "wide_deep_sgd": (lambda: wide_deep(keras.optimizers.SGD(0.5)), wide_deep_data),
          "mp_cnn": (mp_cnn, image_data), "accum": (accum, mlp_data),
          "two_io": (two_io, two_io_data)}


SHORT = ("fp16", "ssp", "easgd")
SHORT_STEPS = 12
EXPORTED = ("sync", "sbn", "always", "reordered")


def strategy_for(variant: str) -> tp.PoseidonStrategy:
    options = {"sync": {}, "reordered": {}, "sbn": {"sync_batchnorm": True},
               "always": {"sfb": "always"},
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


def reversed_within_batches(data: dict) -> dict:
    """``data`` with the rows of every global batch in reverse order (test rows unchanged)."""
    rows = len(tf.nest.flatten(data["y"])[0])
    order = np.concatenate([np.arange(start, min(start + data["batch"], rows))[::-1]
                            for start in range(0, rows, data["batch"])])
    reordered = {k: tf.nest.map_structure(lambda a: a[order], data[k])
                 for k in ("x", "y", "sample_weight") if k in data}
    return dict(data, **reordered)


def weights_of(model, strategy) -> tuple[np.ndarray, np.ndarray]:
    """(trainable, non-trainable) values, concatenated, as every rank agrees on them."""
    with strategy.extended.consistent_state():
        trainable = np.concatenate([v.numpy().ravel() for v in model.trainable_weights])
        non_trainable = np.concatenate([v.numpy().ravel().astype("float64")
                                        for v in model.non_trainable_weights] or [[]])
    return trainable, non_trainable


class Snapshot(keras.callbacks.Callback):
    """The weights after the first SHORT_STEPS steps."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.weights, self.epoch = strategy, None, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == SHORT_STEPS - 1:
            self.weights = weights_of(self.model, self.strategy)


def run(entry: str, out: str) -> None:
    name, variant = entry.split("-")
    build, make_data = MODELS[name]
    data = make_data()
    if variant == "reordered":
        data = reversed_within_batches(data)
    schedule = ({"epochs": 1, "steps_per_epoch": SHORT_STEPS} if variant in SHORT
                else {"epochs": data["epochs"]})
    keras.utils.set_random_seed(SEED + 1000 * tp.rank())
    strategy = strategy_for(variant)
    with strategy.scope():
        model = build()
    fit_args = {k: data[k] for k in ("class_weight", "sample_weight") if k in data}
    initial = model.evaluate(data["x_test"], data["y_test"], batch_size=data["batch"],
                             verbose=0, return_dict=True)
    snapshot = Snapshot(strategy)
    history = model.fit(data["x"], data["y"], batch_size=data["batch"], shuffle=False,
                        verbose=0, callbacks=[snapshot], **schedule, **fit_args)
    evaluation = model.evaluate(data["x_test"], data["y_test"], batch_size=data["batch"],
                                verbose=0, return_dict=True)
    output_names = list(model.output_names)
    predictions = as_dict(model.predict(data["x_test"], batch_size=data["batch"], verbose=0),
                          output_names)
    trainable, non_trainable = weights_of(model, strategy)
    saved = {"trainable": trainable, "non_trainable": non_trainable,
             "loss": history.history["loss"],
             "evaluation": [evaluation[k] for k in sorted(evaluation)],
             "initial_evaluation": [initial[k] for k in sorted(initial)]}
    if snapshot.weights is not None:  # trained for at least SHORT_STEPS steps
        saved.update(trainable_step12=snapshot.weights[0],
                     non_trainable_step12=snapshot.weights[1])
    saved.update({f"predict_{k}": v for k, v in predictions.items()})
    if tp.size() > 1 and variant == "sync":
        saved["plan"] = np.array([f"{r.kernel} {r.choice}" for r in strategy.plan().rows] or
                                 [""])
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
