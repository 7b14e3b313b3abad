"""The compiled kernels of tf_poseidon.ops against stock TensorFlow, in this process
(docs/kernels.md): (a) pack + unpack (float32 <-> float16 wire, scaled) of 50 tensors totalling
100 MB against ``ops.CompositeOps``, eagerly and in tf.function, and against a numpy copy of the
same 100 MB; (b) sfb_reconstruct against ``tf.matmul(U, V, transpose_a=True)`` for the VGG
head's shapes. Candidates run interleaved (A, B, A, B, ...) after a warm-up call each; the
tables give the best and median wall time and the median CPU time of the process per call.
"""

import argparse
import os
import platform
import sys
import time

import numpy as np

from benchmarks.report import table


def timings(candidates: dict, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per candidate (a callable) its (best ms, median ms, median CPU ms) of ``repeats`` runs."""
    runs = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()
    for _ in range(repeats):
        for name, fn in candidates.items():
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            runs[name].append((1e3 * (time.perf_counter() - wall),
                               1e3 * (time.process_time() - cpu)))
    return {name: (min(w for w, _ in r), np.median([w for w, _ in r]),
                   np.median([c for _, c in r])) for name, r in runs.items()}


def pack_unpack(tf, ops, repeats: int) -> list[str]:
    rng = np.random.default_rng(0)
    weights = 10.0 ** rng.uniform(0, 3, size=50)  # log-uniform sizes, like layers
    sizes = np.maximum(1, (weights / weights.sum() * 100e6 / 4).astype(np.int64))
    tensors = [tf.constant(rng.standard_normal(int(n)).astype(np.float32)) for n in sizes]
    nbytes, shapes, dtypes = 4 * int(sizes.sum()), [t.shape for t in tensors], [tf.float32] * 50
    scale, unscale, c = tf.constant(1.0 / 64), tf.constant(64.0), ops.CompositeOps
    compiled = lambda: ops.unpack(ops.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)
    composite = lambda: c.unpack(c.pack(tensors, tf.float16, scale), shapes, dtypes, unscale)
    source = np.concatenate([t.numpy() for t in tensors])
    target, packed = np.empty_like(source), ops.pack(tensors, tf.float16, scale)
    candidates = {  # name -> (call, bytes read + written as a multiple of the float32 size)
        "memcpy (numpy copy, 1 thread)": (lambda: np.copyto(target, source), 2.0),
        "compiled pack": (lambda: ops.pack(tensors, tf.float16, scale), 1.5),
        "compiled unpack": (lambda: ops.unpack(packed, shapes, dtypes, unscale), 1.5),
        "compiled pack+unpack, eager": (compiled, 3.0),
        "compiled pack+unpack, tf.function": (tf.function(compiled), 3.0),
        "composite pack+unpack, eager": (composite, 3.0),
        "composite pack+unpack, tf.function": (tf.function(composite), 3.0)}
    times = timings({name: call for name, (call, _) in candidates.items()}, repeats)
    rate = {name: traffic * nbytes / times[name][0] / 1e6  # GB/s, as ms are 1e-3 s
            for name, (_, traffic) in candidates.items()}
    composite_ms = min(times[f"composite pack+unpack, {m}"][0] for m in ("eager", "tf.function"))
    rows = [[name, *(f"{t:.1f}" for t in times[name]), f"{rate[name]:.1f}",
             f"{100 * rate[name] / rate['memcpy (numpy copy, 1 thread)']:.0f}%",
             f"{composite_ms / times[name][0]:.2f}" if "pack+unpack" in name else ""]
            for name in candidates]
    return [f"(a) pack + unpack, 50 float32 tensors, {nbytes / 1e6:.0f} MB, float16 wire, "
            "scale 1/64", "", *table(["candidate", "best ms", "median ms", "CPU ms",
                                      "GB/s (read+write, best)", "% of memcpy GB/s",
                                      "speed-up vs best composite"], rows)]


def sfb(tf, ops, repeats: int) -> list[str]:
    rng, rows = np.random.default_rng(1), []
    for r, m, n in [(64, 25088, 4096), (64, 4096, 4096), (128, 4096, 1000)]:
        u32 = tf.constant(rng.standard_normal((r, m)).astype(np.float32))
        v32 = tf.constant(rng.standard_normal((r, n)).astype(np.float32))
        u16, v16 = tf.cast(u32, tf.float16), tf.cast(v32, tf.float16)
        for inputs, reference, compiled in [
                ("float32", lambda: tf.matmul(u32, v32, transpose_a=True),
                 lambda: ops.sfb_reconstruct(u32, v32)),
                ("float16 (tf: cast, then matmul)", lambda: tf.matmul(
                    tf.cast(u16, tf.float32), tf.cast(v16, tf.float32), transpose_a=True),
                 lambda: ops.sfb_reconstruct(u16, v16))]:
            ref, ours = timings({"tf": reference, "compiled": compiled}, repeats).values()
            rows.append([f"{r}, {m}, {n}", inputs, " / ".join(f"{x:.1f}" for x in ref),
                         " / ".join(f"{x:.1f}" for x in ours), f"{ours[0] / ref[0]:.2f}",
                         f"{ours[2] / ref[2]:.2f}"])
    return ["(b) sfb_reconstruct vs tf.matmul(U, V, transpose_a=True), float32 [M, N] out", "",
            *table(["R, M, N", "inputs", "tf best / median / CPU ms",
                    "compiled best / median / CPU ms", "compiled/tf best", "compiled/tf CPU"],
                   rows)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
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
    print("\n".join(pack_unpack(tf, ops, args.repeats) + [""] + sfb(tf, ops, args.repeats)))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
