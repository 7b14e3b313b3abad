"""One measurement of the SSP benchmark (benchmarks/bench_ssp.py, under tfposeidon-run).

Keras fit of an MLP on synthetic data. With --straggler, one rank sleeps --delay seconds at the
start of one step in five (injected here, by the benchmark, through a Keras callback): always
rank 0 (``fixed``), or rank 0 the first time, rank 1 the next, ... (``moving``). Either way
exactly one rank is slowed on those steps, so sync mode loses the same time to both. Prints on
rank 0 one JSON line: samples per second over the timed steps (all ranks together), from the
first rank's start of the first timed step to the last rank's end of the last one (under SSP
the ranks' clocks differ by up to s steps).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402


class Straggler(keras.callbacks.Callback):
    def __init__(self, delay, moving):
        super().__init__()
        self.delay = delay
        self.moving = moving

    def on_train_batch_begin(self, batch, logs=None):
        if batch % 5 != 4:
            return
        slowed = (batch // 5) % tp.size() if self.moving else 0
        if tp.rank() == slowed:
            time.sleep(self.delay)


class Clock(keras.callbacks.Callback):
    def __init__(self, warmup):
        super().__init__()
        self.warmup = warmup

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.warmup:
            self.start, self.steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.warmup:
            self.steps += 1
            self.end = time.perf_counter()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--straggler", choices=["none", "fixed", "moving"], default="none")
    parser.add_argument("--delay", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=float, default=None)
    args = parser.parse_args()
    global_batch = args.batch * tp.size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    strategy = tp.PoseidonStrategy(
        mode=args.mode, staleness=args.staleness,
        bucket_bytes=int(args.bucket_mb * 2**20) if args.bucket_mb else None)
    with strategy.scope():
        model = keras.Sequential([keras.Input((args.width,))] +
                                 [keras.layers.Dense(args.width, activation="relu")
                                  for _ in range(3)] + [keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = Clock(args.warmup)
    callbacks = [clock]
    if args.straggler != "none":
        callbacks.append(Straggler(args.delay, moving=args.straggler == "moving"))
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)
    # One host, so the processes' perf_counter clocks are the same clock.
    times = np.zeros([2, tp.size()])
    times[:, tp.rank()] = [-clock.start, clock.end]
    times = strategy.extended.sum_over_ranks([tf.constant(times)], "bench_clock")[0].numpy()
    seconds = times[1].max() + times[0].max()  # latest end − earliest start
    if tp.is_chief():
        print("RESULT " + json.dumps({"samples_per_s": clock.steps * global_batch / seconds,
                                      "fit_end_s": time.perf_counter() - clock.end,
                                      "rank0_mode_stats": strategy.stats()["mode"]}),
              flush=True)


if __name__ == "__main__":
    main()
