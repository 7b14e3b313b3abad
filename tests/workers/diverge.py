"""Worker for test_collective_agreement.py: ranks that post different collectives.

    diverge.py SCENARIO DIR

DIR holds the files a scenario writes. The scenarios:

    chief_evaluate    after fit, only rank 0 runs evaluate (`if tp.is_chief():`)
    callback          a callback reduces on rank 0 only, at the end of epoch 1
    terminate_on_nan  SSP (staleness 2): a NaN in rank 0's rows of batch 3 makes
                      TerminateOnNaN stop training on rank 0 only
    terminate_on_nan_easgd
                      asynchronous EASGD (τ = 2): a NaN in rank 1's rows of the last
                      batch of epoch 1 makes TerminateOnNaN end fit on rank 1 after
                      that epoch while rank 0 trains epoch 2, in which rank 0 waits 2 s
                      before its second batch and 60 s before its fourth (the ranks
                      meet next at the end of that epoch, so a mismatch found only
                      there comes a minute late)
    lengths_steps     rank 0 gets 100 rows, rank 1 130 (batch 32: 4 vs 5 steps)
    lengths_rows      rank 0 gets 100 rows, rank 1 110 (4 steps each, last 4 vs 14)
    values            both ranks get 100 rows, rank 1 in another order (a split drawn
                      on each rank without a seed)
    chief_checkpoint  both ranks save the model, then only rank 0 gives fit a
                      tp.callbacks.ModelCheckpoint (`if tp.is_chief():`, as Horovod
                      scripts add theirs)
    shards            a tf.data pipeline of 128 rows sharded by rank, as a Horovod
                      script shards its data (Dataset.shard(2, rank): 4 batches each)
    slices            each rank's own 64 rows in a tf.data pipeline
                      (Dataset.from_tensor_slices: 4 batches each)
    loop_shards       shards, given to a custom loop's experimental_distribute_dataset
    cache             a tf.data pipeline that caches to one file on every rank
                      (Dataset.cache(filename): 4 batches each)
    loop_chief_checkpoint
                      a custom loop saves a tf.train.CheckpointManager on rank 0 only
                      (`if tp.is_chief():`, as Horovod scripts save theirs) after its
                      second step

Prints ``DIVERGE`` at the point where the ranks go different ways (the rank whose
TerminateOnNaN stops training prints it when it does).
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402

STRATEGIES = {"terminate_on_nan": {"mode": "ssp", "staleness": 2},
              "terminate_on_nan_easgd": {"mode": "easgd", "easgd_async": True, "tau": 2}}


def diverging() -> None:
    print("DIVERGE", flush=True)


class ReportStop(keras.callbacks.Callback):
    """Placed after TerminateOnNaN: says DIVERGE when it has stopped training on this rank."""

    def on_train_batch_end(self, batch, logs=None):
        if self.model.stop_training:
            diverging()


class SlowSecondEpochOnRankZero(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == 0 and self.epoch == 1:
            time.sleep({1: 2, 3: 60}.get(batch, 0))


def main(scenario: str, out: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8)).astype("float32")
    y = rng.normal(size=(160, 1)).astype("float32")
    strategy = tp.PoseidonStrategy(**STRATEGIES.get(scenario, {}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    stopping = [keras.callbacks.TerminateOnNaN(), ReportStop()]
    if scenario == "chief_evaluate":
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        diverging()
        if tp.is_chief():
            model.evaluate(x, y, batch_size=32, verbose=0)
    elif scenario == "callback":
        class ReduceOnRankZero(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                diverging()
                if tp.rank() == 0:
                    strategy.reduce("SUM", tf.constant(1.0), axis=None)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[ReduceOnRankZero()])
    elif scenario == "terminate_on_nan":
        x[3 * 32 + 5] = np.nan  # batch 3, row 5: rank 0's half of it
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=stopping)
    elif scenario == "terminate_on_nan_easgd":
        # Batch 4, row 22: rank 1's half. Its step 5 has no exchange (τ = 2), so the center
        # and rank 0 stay finite.
        x[4 * 32 + 22] = np.nan
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
                  callbacks=[*stopping, SlowSecondEpochOnRankZero()])
    elif scenario == "values":
        order = np.arange(100) if tp.rank() == 0 else np.random.default_rng(1).permutation(100)
        diverging()
        model.fit(x[order], y[order], batch_size=32, epochs=1, verbose=0)
    elif scenario == "chief_checkpoint":
        model.save(os.path.join(out, "start.keras"))  # the collective saves have begun alike
        diverging()
        saving = [tp.callbacks.ModelCheckpoint(os.path.join(out, "epoch{epoch}.keras"))]
        model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                  callbacks=saving if tp.is_chief() else [])
    elif scenario == "shards":
        rows = tf.data.Dataset.from_tensor_slices((x[:128], y[:128]))
        diverging()
        model.fit(rows.shard(tp.size(), tp.rank()).batch(16), epochs=1, verbose=0)
    elif scenario == "loop_shards":
        rows = tf.data.Dataset.from_tensor_slices((x[:128], y[:128]))
        diverging()
        for _ in strategy.experimental_distribute_dataset(
                rows.shard(tp.size(), tp.rank()).batch(16)):
            pass
    elif scenario == "loop_chief_checkpoint":
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), out, 1)

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(features) - labels) ** 2) / 16
            gradients = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        batches = tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(16)
        for i, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
            strategy.run(step, args=batch)
            if i == 1:
                diverging()
                if tp.is_chief():
                    manager.save()
    elif scenario == "cache":
        rows = tf.data.Dataset.from_tensor_slices((x[:128], y[:128]))
        diverging()
        model.fit(rows.cache(os.path.join(out, "rows")).batch(32), epochs=1, verbose=0)
    elif scenario == "slices":
        own = slice(64 * tp.rank(), 64 * (tp.rank() + 1))
        diverging()
        model.fit(tf.data.Dataset.from_tensor_slices((x[own], y[own])).batch(16), epochs=1,
                  verbose=0)
    else:
        mine = 100 if tp.rank() == 0 else {"lengths_steps": 130, "lengths_rows": 110}[scenario]
        diverging()
        model.fit(x[:mine], y[:mine], batch_size=32, epochs=1, verbose=0)
    print(f"rank {tp.rank()} finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
