"""One measurement of the SFB benchmark (run by benchmarks/bench_sfb.py under tfposeidon-run).

Trains an FC-heavy model (``--model fc``: VGG-16's classifier head 25088→4096→4096→1000;
``--model mlp``: ``--layers`` Dense(``--width``)) with Keras fit on synthetic data (one random
global batch fed every step, as Horovod's synthetic benchmark) for ``--warmup`` + ``--steps``
steps, and prints on rank 0 one JSON line ``RESULT {...}``: the median step time of the timed
steps, samples/s, the strategy's bytes per step (strategy.stats()), the bytes this host's eth0
sent per step (its tx_bytes counter, read inside the emulated host), every rank's figures,
and the SFB plan.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402


def tx_bytes() -> int | None:
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


class StepTimer(keras.callbacks.Callback):
    """Per step: wall time, and eth0's tx_bytes at its end."""

    def __init__(self):
        super().__init__()
        self.times, self.tx = [], []

    def on_train_batch_begin(self, batch, logs=None):
        if not self.tx:
            self.tx.append(tx_bytes())
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        self.tx.append(tx_bytes())


def build(args):
    if args.model == "fc":
        return keras.Sequential([
            keras.Input((25088,)),
            keras.layers.Dense(4096, activation="relu", name="fc1"),
            keras.layers.Dense(4096, activation="relu", name="fc2"),
            keras.layers.Dense(1000, activation="softmax", name="predictions")])
    return keras.Sequential([keras.Input((args.width,))] +
                            [keras.layers.Dense(args.width, activation="relu")
                             for _ in range(args.layers)] + [keras.layers.Dense(10)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="fc", choices=["fc", "mlp"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sfb", default="auto")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--single", action="store_true", help="no strategy (compute only)")
    args = parser.parse_args()
    ranks = 1 if args.single else tp.size()
    strategy = None if args.single else tp.PoseidonStrategy(sfb=args.sfb,
                                                            compression=args.compression)
    scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
    with scope:
        model = build(args)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy())
    inputs = model.inputs[0].shape[1]
    classes = model.outputs[0].shape[1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * ranks, inputs)).astype("float32")
    y = rng.integers(0, classes, size=len(x)).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.warmup + args.steps)
    timer = StepTimer()
    model.fit(data, epochs=1, verbose=0, callbacks=[timer])
    timed = timer.times[args.warmup:]
    tx = timer.tx[args.warmup:]
    mine = {"step_time_s": statistics.median(timed),
            "eth0_tx_bytes_per_step": ((tx[-1] - tx[0]) / (len(tx) - 1)
                                       if tx[0] is not None and len(tx) > 1 else None)}
    report = {"ranks": ranks, "sfb": args.sfb, "compression": args.compression,
              "batch_per_rank": args.batch, "parameters": model.count_params(), **mine}
    if strategy is not None:
        summary = strategy.stats(last_steps=args.steps)["summary"]
        report["stats_bytes_sent_per_step"] = summary["bytes_sent"]
        report["comm_time_s"] = summary["comm_time_s"]
        report["per_rank"] = strategy.gather(tf.constant(
            [[mine["step_time_s"], mine["eth0_tx_bytes_per_step"] or -1.0]], tf.float64),
            axis=0).numpy().tolist()
        report["plan"] = strategy.plan().as_dict()
        # Every rank finished its timed steps; the slowest one sets the pace.
        report["step_time_s"] = max(r[0] for r in report["per_rank"])
    report["samples_per_s"] = args.batch * ranks / report["step_time_s"]
    if tp.is_chief():
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
