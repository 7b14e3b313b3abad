"""Worker for test_extension_points.py: a codec and an algorithm defined outside tf_poseidon
(the worked examples of docs/architecture.md), each used for training.

Writes OUT/ext_rank<r>.npz: per case the final weights, the loss history and (codec cases)
the bytes sent per step.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402


class MinMaxUInt8(tp.codecs.Codec):
    """8 bits per value: each block scaled to [0, 255] between its minimum and maximum."""
    name, wire_dtype, meta_size = "minmax8", np.dtype(np.uint8), 2

    def encode(self, block, out):
        lo, hi = (float(block.min()), float(block.max())) if block.size else (0.0, 0.0)
        step = (hi - lo) / 255 or 1.0
        out[...] = np.rint((block - lo) / step)
        return np.array([lo, step])

    def decode(self, wire, meta, out):
        out[...] = meta[0] + wire.astype(np.float32) * meta[1]


@tp.algorithms.register
class LocalSGD(tp.algorithms.Algorithm):
    """Local steps; every `period` steps every rank takes the mean of the ranks' weights."""
    name = "local_sgd"
    lockstep = False

    def __init__(self, period: int = 8):
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period={period!r} must be an integer >= 1")
        self.period = period

    def options(self):
        return {"period": self.period}

    def reify(self, context):
        return LocalSGDImpl(context, self.period)


class LocalSGDImpl(tp.algorithms.AlgorithmImpl):
    def __init__(self, context, period):
        super().__init__(context)
        self.period = period
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def reduce_gradients(self, grads, variables, local_batch):
        return self.local_mean(grads, local_batch)

    def after_update(self, variables):
        def average():
            sums = self.sum_over_ranks("local_sgd", [v.read_value() for v in variables])
            for variable, total in zip(variables, sums):
                variable.assign(total / self.num_replicas)
            return tf.constant(0, tf.int64)
        step = self.step.assign_add(1)
        tf.cond(step % self.period == 0, average, lambda: tf.constant(0, tf.int64))


def main(out):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(960, 20)).astype("float32")
    y = (x[:, :8].sum(1) > 0).astype("int32") + (x[:, 8:12].sum(1) > 1).astype("int32")
    cases = {"fp32": dict(compression="none"), "minmax8": dict(compression=MinMaxUInt8()),
             "local_sgd": dict(algorithm=LocalSGD(period=4)),
             "local_sgd_by_name": dict(mode="local_sgd", period=4)}
    saved = {}
    for name, options in cases.items():
        keras.utils.set_random_seed(7 + tp.rank())
        strategy = tp.PoseidonStrategy(**options)
        with strategy.scope():
            model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        # 960 rows at 64: 15 steps per epoch, 4 epochs = 60 steps (a multiple of the period).
        history = model.fit(x, y, batch_size=64, epochs=4, shuffle=False, verbose=0)
        saved[f"{name}/weights"] = np.concatenate([v.numpy().ravel() for v in model.weights])
        saved[f"{name}/loss"] = np.array(history.history["loss"])
        saved[f"{name}/bytes"] = np.array(strategy.stats(last_steps=5)["summary"]["bytes_sent"])
        saved[f"{name}/algorithm"] = np.array(repr(strategy.config.algorithm))
    np.savez(os.path.join(out, f"ext_rank{tp.rank()}.npz"), **saved)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
