"""Train a small CNN on the 8×8 handwritten digits (examples/data/) with PoseidonStrategy.

    tfposeidon-run -np 2 python examples/train_digits.py          # 2 ranks
    python examples/train_digits.py                               # one process
    tfposeidon-run -np 2 python examples/train_digits.py --lowrank 4 --lowrank-choice always
                                                                  # PowerSGD, rank 4

The Keras code is ordinary: the only tf_poseidon lines are the strategy and its scope. The
batch size given to fit is the global batch, split across ranks. Rank 0 prints the progress bar
and the final test accuracy; the metrics it prints are the global ones.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from digits import load_data  # noqa: E402  (examples/digits.py)


def build_model(kind: str = "cnn") -> keras.Model:
    """A small CNN (``"cnn"``) or a multi-layer perceptron (``"mlp"``) for 8×8 digits."""
    if kind == "mlp":
        return keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def train(args: argparse.Namespace) -> float:
    """Trains under PoseidonStrategy with ``args``; returns the test accuracy (global)."""
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    algorithm = {
        "sync": lambda: tp.algorithms.Sync(),
        "ssp": lambda: tp.algorithms.SSP(staleness=args.staleness),
        # alpha=None: 0.9/P for the synchronous form (it needs alpha·P < 1), 0.5 for async.
        "easgd": lambda: tp.algorithms.EASGD(tau=args.tau, alpha=args.alpha,
                                             easgd_async=args.easgd_async),
    }[args.mode]()
    lowrank = (tp.PowerSGD(rank=args.lowrank, start_step=args.lowrank_start_step,
                           choice=args.lowrank_choice) if args.lowrank else None)
    strategy = tp.PoseidonStrategy(algorithm, compression=args.compression, lowrank=lowrank)
    with strategy.scope():
        model = build_model(args.model)
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_test, y_test), shuffle=False, verbose=args.verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    if tp.is_chief():
        print(f"test accuracy: {accuracy:.4f} ({tp.size()} rank(s), mode={args.mode}, "
              f"model={args.model}, compression={args.compression}, lowrank={lowrank})")
    return accuracy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--mode", default="sync", choices=["sync", "ssp", "easgd"])
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--tau", type=int, default=4, help="EASGD period (docs/easgd.md)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="EASGD moving rate (default 0.9/P; docs/easgd.md)")
    parser.add_argument("--easgd-async", action="store_true")
    parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--lowrank", type=int, default=0, metavar="RANK",
                        help="PowerSGD low-rank compression at this rank (0: off; "
                             "docs/compression.md)")
    parser.add_argument("--lowrank-start-step", type=int, default=10,
                        help="steps summed exactly before compressing")
    parser.add_argument("--lowrank-choice", default="auto", choices=["auto", "always"],
                        help="auto: the per-layer cost model decides; always: every matrix "
                             "that compresses enough")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2])
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
