"""One measurement of the DWBP benchmark (run by benchmarks/bench_dwbp.py under tfposeidon-run).

Trains an MLP of ``--layers`` Dense(``--width``) layers with Keras fit on synthetic data for
``--steps`` steps and prints, on rank 0, one JSON line: median step time after warm-up (from
fit's batch callbacks), and the strategy's communication statistics.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--bucket-bytes", type=int)
    parser.add_argument("--single", action="store_true", help="no strategy (compute only)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    per_step = args.batch * (1 if args.single else tp.size())
    x = rng.normal(size=(per_step * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    strategy = (tp.PoseidonStrategy(overlap=not args.no_overlap, bucket_bytes=args.bucket_bytes)
                if not args.single else None)
    scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
    with scope:
        model = keras.Sequential([keras.Input((args.width,))] +
                                 [keras.layers.Dense(args.width, activation="relu")
                                  for _ in range(args.layers)] + [keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = StepTimer()
    model.fit(x, y, batch_size=per_step, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    if tp.is_chief():
        report = {"step_time_s": statistics.median(timer.times[args.warmup:]),
                  "parameters": model.count_params()}
        if strategy is not None:
            report["comm"] = strategy.stats(last_steps=args.steps - args.warmup)["summary"]
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
