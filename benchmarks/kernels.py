"""The compiled kernels of tf_poseidon.ops against stock TensorFlow, in this process
(docs/kernels.md).

    python -m benchmarks.kernels [--repeats 15] [--intra-op-threads N]

(a) pack + unpack (float32 gradients <-> float16 wire, scaled) of 50 tensors totalling 100 MB,
    against ``ops.CompositeOps`` (cast/reshape/concat and split/reshape/cast), eagerly and in
    tf.function, and against a plain memory copy (numpy) of the same 100 MB in the same run;
(b) sfb_reconstruct against ``tf.matmul(U, V, transpose_a=True)`` for SFB shapes of the VGG head.

Candidates are timed interleaved (A, B, A, B, ...) after one warm-up call each; the tables give
the best and the median wall time of --repeats runs, and the median CPU time of the process
(all threads) per call, which other processes sharing the machine disturb less. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable

import numpy as np

MB = 1e6


def timings(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple]:
    """Per candidate (best ms, median ms, median CPU ms) of ``repeats`` interleaved runs."""
    for fn in candidates.values():
        fn()
    wall = {name: [] for name in candidates}
    cpu = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {name: (1e3 * min(wall[name]), 1e3 * float(np.median(wall[name])),
                   1e3 * float(np.median(cpu[name]))) for name in candidates}


def bench_pack_unpack(repeats: int) -> list[str]:
    import tensorflow as tf
    from tf_poseidon import ops
    rng = np.random.default_rng(0)
    weights = 10.0 ** rng.uniform(0, 3, size=50)  # log-uniform sizes, like layers
    sizes = np.maximum(1, (weights / weights.sum() * 100 * MB / 4).astype(np.int64))
    tensors = [tf.constant(rng.standard_normal(int(n)).astype(np.float32)) for n in sizes]
    nbytes = 4 * int(sizes.sum())
    shapes, dtypes = [t.shape for t in tensors], [tf.float32] * len(tensors)
    scale, unscale = tf.constant(1.0 / 64), tf.constant(64.0)
    compiled = lambda: ops.unpack(ops.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)
    c = ops.CompositeOps
    composite = lambda: c.unpack(c.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)
    source = np.concatenate([t.numpy() for t in tensors])
    target, packed = np.empty_like(source), ops.pack(tensors, tf.float16, scale)
    # name -> (call, bytes read + written as a multiple of the float32 size).
    candidates = {
        "memcpy (numpy copy, 1 thread)": (lambda: np.copyto(target, source), 2.0),
        "compiled pack": (lambda: ops.pack(tensors, tf.float16, scale), 1.5),
        "compiled unpack": (lambda: ops.unpack(packed, shapes, dtypes, unscale), 1.5),
        "compiled pack+unpack, eager": (compiled, 3.0),
        "compiled pack+unpack, tf.function": (tf.function(compiled), 3.0),
        "composite pack+unpack, eager": (composite, 3.0),
        "composite pack+unpack, tf.function": (tf.function(composite), 3.0),
    }
    times = timings({name: call for name, (call, _) in candidates.items()}, repeats)
    memcpy_rate = 2.0 * nbytes / times["memcpy (numpy copy, 1 thread)"][0]
    best_composite = min(times[f"composite pack+unpack, {m}"][0] for m in ("eager", "tf.function"))
    rows = [f"(a) pack + unpack, {len(tensors)} float32 tensors, {nbytes / MB:.0f} MB, float16 "
            "wire, scale 1/64", "",
            "| candidate | best ms | median ms | CPU ms | GB/s (read+write, best) | % of memcpy "
            "GB/s | speed-up vs best composite |", "|---|---|---|---|---|---|---|"]
    for name, (_, traffic) in candidates.items():
        best, median, cpu = times[name]
        rate = traffic * nbytes / best
        speedup = f"{best_composite / best:.2f}" if "pack+unpack" in name else ""
        rows.append(f"| {name} | {best:.1f} | {median:.1f} | {cpu:.1f} | {rate / 1e6:.1f} | "
                    f"{100 * rate / memcpy_rate:.0f}% | {speedup} |")
    return rows


def bench_sfb(repeats: int) -> list[str]:
    import tensorflow as tf
    from tf_poseidon import ops
    rng = np.random.default_rng(1)
    rows = ["(b) sfb_reconstruct vs tf.matmul(U, V, transpose_a=True), float32 [M, N] out", "",
            "| R, M, N | inputs | tf best / median / CPU ms | compiled best / median / CPU ms "
            "| compiled/tf best | compiled/tf CPU |", "|---|---|---|---|---|---|"]
    for r, m, n in [(64, 25088, 4096), (64, 4096, 4096), (128, 4096, 1000)]:
        u32 = tf.constant(rng.standard_normal((r, m)).astype(np.float32))
        v32 = tf.constant(rng.standard_normal((r, n)).astype(np.float32))
        u16, v16 = tf.cast(u32, tf.float16), tf.cast(v32, tf.float16)
        cases = {
            "float32": (lambda: tf.matmul(u32, v32, transpose_a=True),
                        lambda: ops.sfb_reconstruct(u32, v32)),
            "float16 (tf: cast, then matmul)": (
                lambda: tf.matmul(tf.cast(u16, tf.float32), tf.cast(v16, tf.float32),
                                  transpose_a=True),
                lambda: ops.sfb_reconstruct(u16, v16)),
        }
        for inputs, (reference, compiled) in cases.items():
            times = timings({"tf": reference, "compiled": compiled}, repeats)
            ref, ours = times["tf"], times["compiled"]
            rows.append(f"| {r}, {m}, {n} | {inputs} | {' / '.join(f'{x:.1f}' for x in ref)} | "
                        f"{' / '.join(f'{x:.1f}' for x in ours)} | {ours[0] / ref[0]:.2f} | "
                        f"{ours[2] / ref[2]:.2f} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per candidate")
    parser.add_argument("--intra-op-threads", type=int, default=0,
                        help="TensorFlow's intra-op threads (0: default)")
    args = parser.parse_args(argv)
    import tensorflow as tf
    from tf_poseidon import ops
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    if not ops.available():
        raise SystemExit("the compiled ops are not available")
    print(f"TensorFlow {tf.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"intra-op threads {args.intra_op_threads or 'default'}, {args.repeats} interleaved "
          f"runs, load average at start {os.getloadavg()[0]:.1f}\n")
    print("\n".join(bench_pack_unpack(args.repeats) + [""] + bench_sfb(args.repeats)))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
