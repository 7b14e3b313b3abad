"""What collective agreement (tf_poseidon/comm/agreement.py) costs: one check alone, and a
training step of the benchmark MLP with and without the checks, interleaved in one run.

    tfposeidon-run -np 2 python benchmarks/agreement.py [--width 512] [--batch 1024] [--rounds 6]

Rank 0 prints the median time of one check and the step time with checks on and off, per round,
and the median ratio on/off. "Off" replaces the check by a no-op in this process only.
"""

import argparse
import statistics
import time

import keras
import numpy as np

import tf_poseidon as tp
from tf_poseidon import world
from tf_poseidon.comm import agreement


def check_alone(repeats: int) -> float:
    """Seconds per agreement of a 4-bucket gradient signature, on the calling thread."""
    comm = world.mpi_comm()
    signature = agreement.Signature("gradients", 0, (("allreduce", 4 << 20, "float32"),) * 4)
    for _ in range(50):
        agreement.agree(comm, signature, 60)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        agreement.agree(comm, signature, 60)
    return (time.perf_counter() - start) / repeats


def step_times(args) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((args.width,))] + [
            keras.layers.Dense(args.width, activation="relu") for _ in range(3)] +
            [keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:4 * args.batch], y[:4 * args.batch], batch_size=args.batch, verbose=0)
    real = agreement.agree
    times = {"on": [], "off": []}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            agreement.agree = real if mode == "on" else (lambda *_: None)
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
            times[mode].append((time.perf_counter() - start) / args.steps)
    agreement.agree = real
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    alone = check_alone(2000)
    times = step_times(args)
    if tp.is_chief():
        ratios = [a / b for a, b in zip(times["on"], times["off"])]
        print(f"one check: {alone * 1e6:.1f} µs ({tp.size()} ranks)")
        for on, off in zip(times["on"], times["off"]):
            print(f"step with checks {on * 1e3:.2f} ms, without {off * 1e3:.2f} ms")
        print(f"median ratio with/without: {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
