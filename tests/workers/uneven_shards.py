"""Worker: per-rank datasets of different lengths (rank r has 5 + 2r batches).

    uneven_shards.py fit      Keras fit on strategy.distribute_datasets_from_function(...)
    uneven_shards.py loop     a custom loop over the same

Prints "rank R steps S" per epoch; every rank must report the shortest shard's 5 steps.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from custom_loop import train_step  # noqa: E402


def dataset_fn(ctx):
    batches = 5 + 2 * ctx.input_pipeline_id
    rng = np.random.default_rng(ctx.input_pipeline_id)
    x = rng.normal(size=(batches * 8, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


class CountSteps(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        print(f"rank {tp.rank()} steps {self.steps}", flush=True)


def main(how):
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    if how == "fit":
        model.fit(dist, epochs=2, verbose=0, callbacks=[CountSteps()])
        return

    step = train_step(strategy, model, model.optimizer, 8 * tp.size(), sum_loss=False)

    for _ in range(2):
        steps = 0
        for x, y in dist:
            step(x, y)
            steps += 1
        print(f"rank {tp.rank()} steps {steps}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
