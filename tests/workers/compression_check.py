"""Worker for the compression tests.

    compression_check.py codec OUT       16-bit all-reduce vs float64 exact sums (2+ ranks)
    compression_check.py lossscale OUT   LossScaleOptimizer with a NaN in one rank's rows

codec writes OUT/codec_rank<r>.json: relative errors per (compression, size), the NaN/Inf
results, sum_into's results through a non-blocking communicator against the blocking ones,
the strategy's bytes per step for fp32 and fp16 gradient reductions, and how far SGD at lr
1e34 moves a kernel whose gradients are ~1e-35 (normal floats) with each compression.
lossscale writes OUT/lossscale_rank<r>.npz: final weights and loss scale; run it alone and
on several ranks: the step with the NaN must be skipped everywhere alike.
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402


def in_place(codec, comm, x):
    """The codec's sum over ranks of ``x``, into ``x`` itself (as a bucket is summed)."""
    return codec.sum_into(comm, x, x)


def codec(out):
    from tf_poseidon.comm import codecs, collectives
    from tf_poseidon.comm.engine import get_engine

    def exact_sum(comm, x):
        return in_place(codecs.get("none"), comm, x)
    engine = get_engine()
    rng = np.random.default_rng(tp.rank())
    report = {"errors": {}}
    for compression in ("fp16", "bf16"):
        codec = codecs.get(compression)
        for n in (1, 7, 1023, 100003):
            # Magnitudes from 1e-6 to 1e6: beyond fp16's 65504 and below its normal range.
            x = (rng.normal(size=n) * 10.0 ** rng.uniform(-6, 6, size=n)).astype(np.float32)
            exact = engine.call(lambda c: exact_sum(c, x.astype(np.float64)))
            got = engine.call(lambda c: in_place(codec, c, x.copy()))
            report["errors"][f"{compression}/{n}"] = float(
                np.linalg.norm(got - exact) / np.linalg.norm(exact))
        for bad in ("nan", "inf"):
            x = np.ones(11, np.float32)
            if tp.rank() == tp.size() - 1:
                x[5] = float(bad)
            got = engine.call(lambda c: in_place(codec, c, x.copy()))
            report[f"{compression}/{bad}"] = [str(v) for v in got[4:7]]
    # sum_into through a YieldingComm (SSP's delta exchange: MPI's non-blocking collectives)
    # and blocking, in place: the same bits where the codec sums itself (fp16, bf16: MPI only
    # moves bytes); for float32, whose sum is MPI's (its blocking and non-blocking all-reduces
    # may add in different orders), whether each is within float32 summation's bound of the
    # float64 sum ((P - 1) additions, at most eps·sum|x| each). The payload left as it was.
    for name in ("none", "fp16", "bf16"):
        collective = codecs.get(name)
        x = rng.normal(size=100003).astype(np.float32)
        kept = x.copy()
        into = np.full_like(x, np.nan)
        got = engine.call(lambda c: collective.sum_into(collectives.YieldingComm(c), x, into))
        blocking = engine.call(lambda c: in_place(collective, c, kept.copy()))
        exact = engine.call(lambda c: exact_sum(c, x.astype(np.float64)))
        bound = (tp.size() - 1) * np.finfo(np.float32).eps * engine.call(
            lambda c: exact_sum(c, np.abs(x).astype(np.float64)))
        report[f"sum_into/{name}"] = {
            "is_out": got is into, "payload_intact": bool(np.array_equal(x, kept)),
            "equal": bool(np.array_equal(got, blocking)),
            "within_bound": bool(np.all(np.abs(got - exact) <= bound)
                                 and np.all(np.abs(blocking - exact) <= bound)),
            "digest": hashlib.sha256(got.tobytes() + blocking.tobytes()).hexdigest()}
    for compression in ("none", "fp16"):
        strategy = tp.PoseidonStrategy(compression=compression)
        with strategy.scope():
            model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(1000)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((64, 100), np.float32), np.ones((64, 1000), np.float32),
                  batch_size=32, verbose=0)
        # stats() covers the process's last steps: this fit's two.
        report[f"bytes/{compression}"] = strategy.stats(last_steps=2)["summary"]["bytes_sent"]
    for compression in ("none", "fp16"):
        # A gradient of -2e-36 per element (as sent: ~7e-36, weighted by the batch share), in
        # a bucket of its own (bucket_bytes=4: not with the batch-share count): at 3 ranks the
        # fp16 scale LIMIT/(P·amax) would exceed float32's range.
        strategy = tp.PoseidonStrategy(compression=compression, bucket_bytes=4)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer="zeros")])
            model.compile(optimizer=keras.optimizers.SGD(1e34), loss="mse")
        model.fit(np.full((60, 8), 1e-36, np.float32), np.ones((60, 1), np.float32),
                  batch_size=30, verbose=0)
        report[f"tiny/{compression}"] = model.get_weights()[0].ravel().tolist()
    with open(os.path.join(out, f"codec_rank{tp.rank()}.json"), "w") as f:
        json.dump(report, f)


def lossscale(out):
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 6, 8)).astype("float32")
    y = rng.normal(size=(64 * 6, 1)).astype("float32")
    x[2 * 64 + 40, 3] = np.nan  # batch 2, row 40: on rank 1 of 2 (rows 32..63)
    strategy = tp.PoseidonStrategy(compression="fp16")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    np.savez(os.path.join(out, f"lossscale_rank{tp.rank()}.npz"),
             weights=np.concatenate([w.numpy().ravel() for w in model.weights]),
             scale=float(optimizer.dynamic_scale.numpy()))


if __name__ == "__main__":
    {"codec": codec, "lossscale": lossscale}[sys.argv[1]](sys.argv[2])
