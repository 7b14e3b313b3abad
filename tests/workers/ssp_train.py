"""Worker for the SSP tests: fits in the modes given, one after another, and what the tests
compare of each.

    ssp_train.py RUN [RUN ...]
    RUN: "OUT --mode sync|ssp --staleness S [--rows N] [--straggle] [--loop]
          [--compression none|fp16|bf16] [--dtype float32|bfloat16]"  (one argument each)

Each run builds its model with the same seeds and its own strategy, and writes
OUT/rank<r>.npz (weights after fit, i.e. after its drain; loss history) and
OUT/stats_rank<r>.json (strategy.stats()["mode"]). --straggle slows rank 1 in every other step
so that the others run ahead (up to the bound). --loop trains with a custom loop instead of fit
and drains explicitly with strategy.drain(). --dtype sets the Dense layers' dtype (and so their
variables').
"""

import argparse
import json
import os
import shlex
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from custom_loop import train_step  # noqa: E402


class Straggle(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == 1 and batch % 2:
            time.sleep(0.05)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", default="ssp")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--straggle", action="store_true")
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(11 + tp.rank())
    rng = np.random.default_rng(2)
    x = rng.normal(size=(args.rows, 20)).astype("float32")
    y = (x[:, :4].sum(1) > 0).astype("int32")
    strategy = tp.PoseidonStrategy(mode=args.mode, staleness=args.staleness,
                                   compression=args.compression)
    with strategy.scope():
        model = keras.Sequential([keras.Input((20,)),
                                  keras.layers.Dense(64, activation="relu", dtype=args.dtype),
                                  keras.layers.Dense(2, dtype=args.dtype)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if args.loop:
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(64))

        step = train_step(strategy, model, model.optimizer, 64, sum_loss=False)

        for _ in range(2):
            for xb, yb in dist:
                step(xb, yb)
        strategy.drain()
        loss = []
    else:
        callbacks = [Straggle()] if args.straggle else []
        loss = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                         callbacks=callbacks).history["loss"]
    np.savez(os.path.join(args.out, f"rank{tp.rank()}.npz"),
             weights=np.concatenate([v.numpy().astype(np.float32).ravel()
                                     for v in model.weights]), loss=loss)
    with open(os.path.join(args.out, f"stats_rank{tp.rank()}.json"), "w") as f:
        json.dump(strategy.stats().get("mode", {}), f)


if __name__ == "__main__":
    for run in sys.argv[1:]:
        main(shlex.split(run))
