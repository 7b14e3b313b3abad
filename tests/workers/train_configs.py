"""Worker for the exactness tests: trains several small models, saves what the tests compare.

    train_configs.py RUN [RUN ...]
    RUN: "OUT [--configs C,C,...] [--rows N] [--epochs E] [--strategy JSON]" (one argument each)

Run under mpirun (or alone). Each run seeds every rank with its own rank, so rank 0's initial
values must reach the others for them to train in lockstep and its seed decides the order
Keras fit shuffles in (by default, as here) on every rank, and has its own strategy
(``tp.PoseidonStrategy(**JSON)``). A configuration is MODEL-OPTIMIZER (``mlp-sgd``: Keras
fit), or MODEL-OPTIMIZER@loop / @function: a custom training loop over
``experimental_distribute_dataset`` / ``distribute_datasets_from_function``. MODEL: mlp, cnn,
dropout (the MLP with Dropout and GaussianNoise) or penalties (the MLP with losses added by its
layers: an activity regularizer and an ``add_loss`` of a mean over the rows). Writes, on every
rank, OUT/<config>_rank<r>.npz with the final weights, the fit history and the predictions, and
OUT/stats_rank<r>.json (strategy.stats()["mode"]).
"""

import argparse
import json
import os
import shlex
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from custom_loop import train_step  # noqa: E402

GLOBAL_BATCH = 60


def data(n: int, image: bool):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(n, 6, 6, 2) if image else (n, 12)).astype("float32")
    y = (x.reshape(n, -1)[:, :5].sum(1) > 0).astype("int32") + \
        (x.reshape(n, -1)[:, 5:9].sum(1) > 1).astype("int32")
    return x, y


class RowMeanPenalty(keras.layers.Layer):
    """The identity, adding a loss that is a mean over the batch's rows (as a VAE's KL term)."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.sum(keras.ops.square(x), axis=-1)))
        return x


def model_for(kind: str) -> keras.Model:
    if kind == "penalties":
        penalized = keras.layers.Dense(32, activation="tanh",
                                       activity_regularizer=keras.regularizers.L2(0.01))
        layers = [keras.Input((12,)), penalized, RowMeanPenalty(),
                  keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    elif kind == "mlp":
        layers = [keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                  keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    elif kind == "dropout":  # the MLP with random layers
        layers = [keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                  keras.layers.Dropout(0.3), keras.layers.Dense(16, activation="relu"),
                  keras.layers.GaussianNoise(0.2), keras.layers.Dense(3)]
    else:
        layers = [keras.Input((6, 6, 2)), keras.layers.Conv2D(8, 3, activation="relu"),
                  keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.Flatten(),
                  keras.layers.Dense(3)]
    return keras.Sequential(layers)


def optimizer_for(name: str):
    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(0.01)


def weights_of(model) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in model.weights])


def run_fit(strategy, kind, opt, n, epochs, out):
    x, y = data(n, kind == "cnn")
    with strategy.scope():
        model = model_for(kind)
        model.compile(optimizer=optimizer_for(opt),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, verbose=0)
    predictions = model.predict(x[:77], batch_size=20, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    np.savez(out, weights=weights_of(model), loss=history.history["loss"],
             accuracy=history.history["accuracy"], predictions=predictions,
             evaluation=evaluation, optimizer=np.concatenate([v.numpy().ravel() for v in model.optimizer.variables]))


def run_custom_loop(strategy, kind, opt, n, epochs, out, from_function):
    x, y = data(n, kind == "cnn")
    with strategy.scope():
        model = model_for(kind)
        optimizer = optimizer_for(opt)
    if from_function:
        def dataset_fn(ctx):
            # Pipeline r reads its own rows of every global batch (balanced, contiguous).
            r, p = ctx.input_pipeline_id, ctx.num_input_pipelines
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

            def rows(a, b):
                n = tf.shape(a)[0]
                return a[n * r // p:n * (r + 1) // p], b[n * r // p:n * (r + 1) // p]
            return ds.map(rows)
        dist = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    step = train_step(strategy, model, optimizer, GLOBAL_BATCH)

    losses = []
    for _ in range(epochs):
        for xb, yb in dist:
            losses.append(float(step(xb, yb)))
    np.savez(out, weights=weights_of(model), loss=np.array(losses))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--configs", default="mlp-sgd,mlp-adam,cnn-sgd,cnn-adam")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", default="{}", help="PoseidonStrategy options, JSON")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(100 + tp.rank())
    strategy = tp.PoseidonStrategy(**json.loads(args.strategy))
    for config in args.configs.split(","):
        model, _, loop = config.partition("@")
        kind, opt = model.split("-")
        out = os.path.join(args.out, f"{config}_rank{tp.rank()}.npz")
        if loop:
            run_custom_loop(strategy, kind, opt, args.rows, args.epochs, out,
                            from_function={"loop": False, "function": True}[loop])
        else:
            run_fit(strategy, kind, opt, args.rows, args.epochs, out)
    with open(os.path.join(args.out, f"stats_rank{tp.rank()}.json"), "w") as f:
        json.dump(strategy.stats().get("mode", {}), f)


if __name__ == "__main__":
    for run in sys.argv[1:]:
        main(shlex.split(run))
    print(f"rank {tp.rank()} done", flush=True)
