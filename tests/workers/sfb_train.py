"""Worker for the SFB tests: trains an MLP with wide Dense layers by Keras fit, then dumps.

    sfb_train.py OUT RUN[,RUN...] [--rows N] [--batch B] [--epochs E] [--bandwidth-gbps G]

    RUN = MODEL/SFB[/FLAG...]: MODEL sequential|functional|subclassed|shared|sequence,
    SFB auto|always|never, FLAGs reg (L2 kernel_regularizer on the first layer), fp16|bf16,
    adam (else SGD with momentum), loop (a custom training loop instead of fit), nooverlap,
    save, rowsN (data set size, default --rows),
    bwG (bandwidth_gbps=G), bucketsN (bucket_bytes=N).

Each run builds its own strategy and model; every rank seeds with its own rank (rank 0's
initial values must reach the others). Per run NAME (RUN with "-" for "/"), every rank writes
OUT/NAME_rank<r>.npz (final weights in model.weights order, loss history),
OUT/NAME_plan_rank<r>.json (strategy.plan().as_dict()) and OUT/NAME_stats_rank<r>.json
(strategy.stats()); with the flag save, every rank calls model.save(OUT/NAME.keras) (rank 0 writes).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from custom_loop import train_step  # noqa: E402

FEATURES, WIDE, CLASSES = 40, 192, 5


class Subclassed(keras.Model):
    def __init__(self, regularizer=None):
        super().__init__()
        self.hidden1 = keras.layers.Dense(WIDE, activation="tanh",
                                          kernel_regularizer=regularizer, name="hidden1")
        self.hidden2 = keras.layers.Dense(WIDE, activation="relu", use_bias=False,
                                          name="hidden2")
        self.logits = keras.layers.Dense(CLASSES, name="logits")

    def call(self, x):
        return self.logits(self.hidden2(self.hidden1(x)))


def build(kind: str, regularizer):
    if kind == "subclassed":
        model = Subclassed(regularizer)
        model(np.zeros((1, FEATURES), "float32"))
        return model
    if kind == "sequential":
        return keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(WIDE, activation="tanh", kernel_regularizer=regularizer,
                               name="hidden1"),
            keras.layers.Dense(WIDE, activation="relu", use_bias=False, name="hidden2"),
            keras.layers.Dense(CLASSES, name="logits")])
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(WIDE, activation="tanh", kernel_regularizer=regularizer,
                                name="hidden1")(inputs)
    if kind == "shared":  # one layer applied twice: its kernel is used twice per step
        square = keras.layers.Dense(WIDE, activation="tanh", name="shared")
        hidden = square(square(hidden))
    elif kind == "sequence":  # a Dense on a 3-D input (batch, time, features)
        hidden = keras.layers.Reshape((4, WIDE // 4))(hidden)
        hidden = keras.layers.Dense(WIDE // 4, activation="relu", name="per_step")(hidden)
        hidden = keras.layers.Flatten()(hidden)
    else:
        hidden = keras.layers.Dense(WIDE, activation="relu", use_bias=False,
                                    name="hidden2")(hidden)
    outputs = keras.layers.Dense(CLASSES, name="logits")(hidden)
    return keras.Model(inputs, outputs)


def custom_loop(strategy, model, x, y, global_batch, epochs):
    """strategy.run + GradientTape + apply_gradients, TensorFlow's convention for the loss."""
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))

    step = train_step(strategy, model, model.optimizer, global_batch)

    losses = []
    for _ in range(epochs):
        for xb, yb in data:
            losses.append(float(step(xb, yb)))
    return losses


def run(spec: str, args) -> None:
    """One training run: spec is MODEL/SFB[/FLAG...] (see the module docstring)."""
    kind, sfb, *flags = spec.split("/")
    numbers = {f.rstrip("0123456789."): float(f.lstrip("abcdefghijklmnopqrstuvwxyz"))
               for f in flags if f[-1].isdigit()}
    rows = int(numbers.get("rows", args.rows))
    keras.utils.set_random_seed(11 + tp.rank())
    rng = np.random.default_rng(5)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (np.abs(x[:, :CLASSES]).argmax(1)).astype("int32")
    compression = "fp16" if "fp16" in flags else "bf16" if "bf16" in flags else "none"
    strategy = tp.PoseidonStrategy(sfb=sfb, compression=compression,
                                   overlap="nooverlap" not in flags,
                                   bandwidth_gbps=numbers.get("bw", args.bandwidth_gbps),
                                   bucket_bytes=int(numbers["buckets"]) if "buckets" in numbers
                                   else None)
    regularizer = keras.regularizers.L2(0.01) if "reg" in flags else None
    before = strategy.plan().as_dict()["note"]  # nothing traced yet
    with strategy.scope():
        model = build(kind, regularizer)
        optimizer = (keras.optimizers.Adam(0.003) if "adam" in flags
                     else keras.optimizers.SGD(0.05, momentum=0.9))
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if "loop" in flags:
        losses = custom_loop(strategy, model, x, y, args.batch, args.epochs)
    else:
        losses = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                           verbose=0).history["loss"]
    plan = strategy.plan().as_dict()
    plan["note_before_fit"] = before
    steps = -(-rows // args.batch) * args.epochs
    name = spec.replace("/", "-")
    weights = np.concatenate([v.numpy().ravel() for v in model.weights])
    np.savez(os.path.join(args.out, f"{name}_rank{tp.rank()}.npz"), weights=weights,
             loss=losses)
    with open(os.path.join(args.out, f"{name}_plan_rank{tp.rank()}.json"), "w") as f:
        json.dump(plan, f)
    with open(os.path.join(args.out, f"{name}_stats_rank{tp.rank()}.json"), "w") as f:
        # The engine's log is the process's: this run's steps are the last ones.
        json.dump(strategy.stats(last_steps=steps), f)
    if "save" in flags:  # every rank calls it; rank 0 writes
        model.save(os.path.join(args.out, f"{name}.keras"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs", help="comma-separated MODEL/SFB[/flag...] specs")
    parser.add_argument("--rows", type=int, default=640)
    parser.add_argument("--batch", type=int, default=32, help="global")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--bandwidth-gbps", type=float)
    args = parser.parse_args()
    for spec in args.runs.split(","):
        run(spec, args)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    main()
