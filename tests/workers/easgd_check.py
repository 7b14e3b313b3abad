"""Worker for tests/test_easgd.py: trains a linear model under mode="easgd" with Keras fit and
writes what the test checks, on every rank, to OUT/rank<r>.npz.

    tfposeidon-run -np 3 python tests/workers/easgd_check.py OUT --tau 3 --alpha 0.3
    tfposeidon-run -np 2 python tests/workers/easgd_check.py OUT --async --tau 1 --alpha 0.5 \
        --slow-rank 1 --slow-s 0.25

The model is Dense(1) with mean squared error and plain SGD, so the test can replay the
synchronous form exactly in numpy from the saved initial weights and data. Every rank seeds
differently (rank 0's initial weights must reach the others). Saved: the data, each rank's
own initial weights (before rank 0's are broadcast), the weights at the end of epoch 0 outside
and inside ``consistent_state`` and after leaving it, the local weights at the end of training
(before ``fit``'s drain), the weights after ``fit``, evaluate's results, per-batch end times,
and the algorithm's stats; with --second-fit, the same for one more epoch after setting
different weights on every rank.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402

ROWS, FEATURES = 120, 4


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32") + 0.7)[:, None].astype("float32")
    return x, y


def flat(model) -> np.ndarray:
    return np.concatenate([w.ravel() for w in model.get_weights()])


class Recorder(keras.callbacks.Callback):
    def __init__(self, strategy, slow_rank: int, slow_s: float):
        super().__init__()
        self.strategy, self.slow_rank, self.slow_s = strategy, slow_rank, slow_s
        self.saved = {"batch_end_s": []}

    def on_train_begin(self, logs=None):
        # Before the first step: this rank's own initial weights (rank 0's become everyone's).
        self.saved["initial"] = flat(self.model)
        self.start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == self.slow_rank:
            time.sleep(self.slow_s)  # injected slowness: this rank's steps take longer

    def on_train_batch_end(self, batch, logs=None):
        self.saved["batch_end_s"].append(time.perf_counter() - self.start)

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 0:
            return
        self.saved["epoch0_local"] = flat(self.model)
        with self.strategy.extended.consistent_state():
            self.saved["epoch0_center"] = flat(self.model)
            with self.strategy.extended.consistent_state():  # re-entrant: nothing more swapped
                self.saved["epoch0_nested"] = flat(self.model)
        self.saved["epoch0_after"] = flat(self.model)

    def on_train_end(self, logs=None):
        self.saved["final_local"] = flat(self.model)
        self.saved["end_s"] = time.perf_counter() - self.start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--tau", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.3)
    parser.add_argument("--batch", type=int, default=12, help="global batch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--second-fit", action="store_true",
                        help="then set rank-dependent weights and fit one more epoch")
    args = parser.parse_args()
    keras.utils.set_random_seed(100 + tp.rank())
    x, y = data()
    strategy = tp.PoseidonStrategy(mode="easgd", tau=args.tau, alpha=args.alpha,
                                   easgd_async=args.asynchronous, compression=args.compression)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(args.learning_rate), loss="mse",
                      steps_per_execution=args.steps_per_execution)
    recorder = Recorder(strategy, args.slow_rank, args.slow_s)
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0,
              validation_data=(x[:30], y[:30]), callbacks=[recorder])
    saved = dict(recorder.saved)
    saved["after_fit"] = flat(model)
    saved["evaluate"] = np.array(model.evaluate(x, y, batch_size=40, verbose=0), ndmin=1)
    saved["after_evaluate"] = flat(model)
    saved["x"], saved["y"] = x, y
    saved["stats"] = np.array(json.dumps(strategy.stats()["mode"]))
    if args.second_fit:
        # Weights set between two fits, differently on every rank: the next fit starts its
        # center from rank 0's, and each rank's local weights from its own.
        model.set_weights([w + 0.1 * (tp.rank() + 1) for w in model.get_weights()])
        saved["second_initial"] = flat(model)
        second = Recorder(strategy, -1, 0.0)
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[second])
        saved["second_final_local"] = second.saved["final_local"]
        saved["second_after_fit"] = flat(model)
    np.savez(os.path.join(args.out, f"rank{tp.rank()}.npz"), **saved)


if __name__ == "__main__":
    main()
