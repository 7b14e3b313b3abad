"""One measurement of the EASGD benchmark (run by benchmarks/bench_easgd.py, tfposeidon-run).

Trains an MLP (``--layers`` Dense(``--width``)) with Keras fit on synthetic data for
``--warmup`` + ``--steps`` steps, one epoch, and prints on every rank one line
``RESULT {...}``: this rank's mean and median step time and its throughput over the timed
steps (its own
steps only: the wait for the others at the end of the epoch is not in it), and the bytes this
rank sent and received per step during fit (engine records: gradients and metrics in sync
mode, the elastic all-reduces of synchronous EASGD; the exchange counters of asynchronous
EASGD, on rank 0 including the holder's replies).

``--slow-rank R --slow-s S`` makes rank R take S seconds longer per step, injected here by a
Keras callback (``--slow-kind sleep`` sleeps, which frees R's core; ``spin`` keeps it busy).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_poseidon as tp  # noqa: E402  (first: it sizes TensorFlow's thread pools)

import keras  # noqa: E402
import numpy as np  # noqa: E402


class StepClock(keras.callbacks.Callback):
    """Per-step times of this rank, and the slowness injected into one rank's steps."""

    def __init__(self, warmup: int, slow: bool, slow_s: float, slow_kind: str):
        super().__init__()
        self.warmup, self.slow, self.slow_s, self.slow_kind = warmup, slow, slow_s, slow_kind
        self.ends: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        if self.slow and self.slow_s > 0:
            if self.slow_kind == "sleep":
                time.sleep(self.slow_s)
            else:
                until = time.perf_counter() + self.slow_s
                while time.perf_counter() < until:
                    pass

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--options", default="{}", help="PoseidonStrategy kwargs, JSON")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-kind", choices=["sleep", "spin"], default="sleep")
    args = parser.parse_args()
    options = json.loads(args.options)
    strategy = tp.PoseidonStrategy(**options)
    size, rank = tp.size(), tp.rank()
    rng = np.random.default_rng(0)
    total = args.warmup + args.steps
    x = rng.normal(size=(args.batch * size * total, args.width)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((args.width,))] +
                                 [keras.layers.Dense(args.width, activation="relu")
                                  for _ in range(args.layers)] + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    engine = strategy.extended.engine
    clock = StepClock(args.warmup, rank == args.slow_rank, args.slow_s, args.slow_kind)
    model.fit(x, y, batch_size=args.batch * size, epochs=1, shuffle=False, verbose=0,
              callbacks=[clock])
    ends = clock.ends
    timed = np.diff(ends[args.warmup - 1:])
    span = ends[-1] - ends[args.warmup - 1]
    # Bytes: everything this rank sent and received during fit, per step (the exchanges are
    # a fixed number per τ steps, whereas the ranks' timed windows differ in async mode).
    records = engine.stats.records()
    groups = sorted({r.group for r in records})
    sent = sum(r.bytes_sent for r in records)
    received = sum(r.bytes_received for r in records)
    if strategy.config.algorithm.asynchronous:
        stats = strategy.extended.algorithm_impl.stats()
        served = stats.get("served", {"bytes_sent": 0, "bytes_received": 0})
        sent += stats["bytes_sent"] + served["bytes_sent"]
        received += stats["bytes_received"] + served["bytes_received"]
    report = {
        "rank": rank, "size": size, "options": options,
        "slowed": rank == args.slow_rank, "slow_s": args.slow_s if rank == args.slow_rank else 0,
        "median_step_s": statistics.median(timed),
        "mean_step_s": span / args.steps,
        "samples_per_s": args.steps * args.batch / span,
        "bytes_sent_per_step": sent / total,
        "bytes_received_per_step": received / total,
        "engine_groups": groups,
        "parameters": model.count_params(),
    }
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
