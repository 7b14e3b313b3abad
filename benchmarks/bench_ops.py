"""Benchmark of the compiled kernels of tf_poseidon.ops against stock TensorFlow (not a test).

(a) pack + unpack (float32 gradients <-> float16 wire, scaled) of 50 tensors totalling 100 MB, vs
    ``ops.CompositeOps`` (cast/reshape/concat and split/reshape/cast), eagerly and in tf.function,
    and vs a plain memory copy (numpy) of the same 100 MB measured in the same run;
(b) sfb_reconstruct vs ``tf.matmul(U, V, transpose_a=True)`` for SFB shapes of the VGG head.

Candidates are timed interleaved (A, B, A, B, ...); the best wall time of ``--repeats`` runs is
reported with the median, and the median CPU time of the process (all threads) per call, which
other processes sharing the machine disturb less. Prints markdown tables.

    python -m benchmarks.bench_ops [--repeats 15] [--intra-op-threads N]   # from the repo root
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tf_poseidon import ops

MB = 1e6


class Timing:
    """Wall-clock and process CPU seconds of each run of one candidate."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def best_ms(self) -> float:
        return 1e3 * min(self.wall)

    def median_ms(self) -> float:
        return 1e3 * float(np.median(self.wall))

    def cpu_ms(self) -> float:
        return 1e3 * float(np.median(self.cpu))


def timings(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Times each candidate ``repeats`` times, runs interleaved, after one warm-up call each."""
    for fn in candidates.values():
        fn()
    times = {name: Timing() for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            times[name].wall.append(time.perf_counter() - wall)
            times[name].cpu.append(time.process_time() - cpu)
    return times


def gradient_like_tensors(
    rng: np.random.Generator, count: int, total_bytes: float
) -> list[tf.Tensor]:
    """``count`` float32 tensors of log-uniform sizes (like layers) totalling ``total_bytes``."""
    weights = 10.0 ** rng.uniform(0, 3, size=count)
    sizes = np.maximum(1, (weights / weights.sum() * total_bytes / 4).astype(np.int64))
    return [tf.constant(rng.standard_normal(int(n)).astype(np.float32)) for n in sizes]


def bench_pack_unpack(repeats: int) -> list[str]:
    rng = np.random.default_rng(0)
    tensors = gradient_like_tensors(rng, 50, 100 * MB)
    nbytes = sum(int(t.shape.num_elements()) * 4 for t in tensors)
    shapes = [t.shape for t in tensors]
    dtypes = [tf.float32] * len(tensors)
    scale = tf.constant(1.0 / 64)
    unscale = tf.constant(64.0)
    composite = ops.CompositeOps

    def compiled_roundtrip():
        return ops.unpack(ops.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)

    def composite_roundtrip():
        return composite.unpack(composite.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)

    source = np.concatenate([t.numpy() for t in tensors])
    target = np.empty_like(source)
    packed = ops.pack(tensors, tf.float16, scale)
    # name -> (call, bytes read + written as a multiple of the float32 size).
    candidates = {
        "memcpy (numpy copy, 1 thread)": (lambda: np.copyto(target, source), 2.0),
        "compiled pack": (lambda: ops.pack(tensors, tf.float16, scale), 1.5),
        "compiled unpack": (lambda: ops.unpack(packed, shapes, dtypes, unscale), 1.5),
        "compiled pack+unpack, eager": (compiled_roundtrip, 3.0),
        "compiled pack+unpack, tf.function": (tf.function(compiled_roundtrip), 3.0),
        "composite pack+unpack, eager": (composite_roundtrip, 3.0),
        "composite pack+unpack, tf.function": (tf.function(composite_roundtrip), 3.0),
    }
    times = timings({name: call for name, (call, _) in candidates.items()}, repeats)
    memcpy_rate = 2.0 * nbytes / times["memcpy (numpy copy, 1 thread)"].best_ms()
    composite_ms = min(
        times[f"composite pack+unpack, {mode}"].best_ms() for mode in ("eager", "tf.function")
    )
    rows = [
        f"(a) pack + unpack, {len(tensors)} float32 tensors, {nbytes / MB:.0f} MB, "
        "float16 wire, scale 1/64",
        "",
        "| candidate | best ms | median ms | CPU ms | GB/s (read+write, best) | % of memcpy GB/s "
        "| speed-up vs best composite |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (_, traffic) in candidates.items():
        timing = times[name]
        rate = traffic * nbytes / timing.best_ms()
        speedup = f"{composite_ms / timing.best_ms():.2f}" if "pack+unpack" in name else ""
        rows.append(
            f"| {name} | {timing.best_ms():.1f} | {timing.median_ms():.1f} | {timing.cpu_ms():.1f} "
            f"| {rate / 1e6:.1f} | {100 * rate / memcpy_rate:.0f}% | {speedup} |"
        )
    return rows


def bench_sfb(repeats: int) -> list[str]:
    rng = np.random.default_rng(1)
    rows = [
        "(b) sfb_reconstruct vs tf.matmul(U, V, transpose_a=True), float32 [M, N] out",
        "",
        "| R, M, N | inputs | tf best / median / CPU ms | compiled best / median / CPU ms "
        "| compiled/tf best | compiled/tf CPU |",
        "|---|---|---|---|---|---|",
    ]
    for r, m, n in [(64, 25088, 4096), (64, 4096, 4096), (128, 4096, 1000)]:
        u32 = tf.constant(rng.standard_normal((r, m)).astype(np.float32))
        v32 = tf.constant(rng.standard_normal((r, n)).astype(np.float32))
        u16, v16 = tf.cast(u32, tf.float16), tf.cast(v32, tf.float16)
        cases = {
            "float32": (
                lambda: tf.matmul(u32, v32, transpose_a=True),
                lambda: ops.sfb_reconstruct(u32, v32),
            ),
            "float16 (tf: cast, then matmul)": (
                lambda: tf.matmul(
                    tf.cast(u16, tf.float32), tf.cast(v16, tf.float32), transpose_a=True
                ),
                lambda: ops.sfb_reconstruct(u16, v16),
            ),
        }
        for inputs, (reference, compiled) in cases.items():
            times = timings({"tf": reference, "compiled": compiled}, repeats)
            ref, ours = times["tf"], times["compiled"]
            rows.append(
                f"| {r}, {m}, {n} | {inputs} "
                f"| {ref.best_ms():.1f} / {ref.median_ms():.1f} / {ref.cpu_ms():.1f} "
                f"| {ours.best_ms():.1f} / {ours.median_ms():.1f} / {ours.cpu_ms():.1f} "
                f"| {ours.best_ms() / ref.best_ms():.2f} | {ours.cpu_ms() / ref.cpu_ms():.2f} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per candidate")
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="TensorFlow's intra-op threads (0: default)"
    )
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    if not ops.available():
        raise SystemExit("the compiled ops are not available")
    print(
        f"TensorFlow {tf.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"intra-op threads {args.intra_op_threads or 'default'}, "
        f"{args.repeats} interleaved runs, load average at start {os.getloadavg()[0]:.1f}\n"
    )
    print("\n".join(bench_pack_unpack(args.repeats)))
    print()
    print("\n".join(bench_sfb(args.repeats)))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
