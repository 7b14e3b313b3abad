"""GPU timings of tf_poseidon's compiled ops in TensorFlow, for ci/check_gpu.sh (not a test).

(a) pack and unpack of 50 float32 tensors totalling 2 GB <-> a float16 wire (scaled), compiled
    vs ``ops.CompositeOps`` (both in tf.function), and against TensorFlow's device memcpy
    (``DeepCopy`` of the float32 tensors' bytes, timed the same way; bandwidth counts bytes read
    plus written). Goals: pack+unpack >= 1.5x faster than the composite; each >= 50% of memcpy.
(b) sfb_reconstruct vs TensorFlow's matmul at the same precision: float32 with TensorFloat-32
    on (TF's default) and off, and float16 factors (TF: cast to float32, then matmul).
    Goal: <= 1.1x TF's time.

Times are medians over 5 rounds of 10 back-to-back calls, each round ended by fetching one
element (so the device's queue is drained). Prints markdown table rows "| tf | ... |", one
PASS/FAIL line per goal and, last, "goals: N met, M missed"; exit status 1 if a goal is missed
(or the device or the compiled ops are missing).

    python ci/gpu_bench.py                                  # repository root on PYTHONPATH
    python ci/gpu_bench.py --device CPU --elements 10000000 --sfb-shape 32,512,256

The second form runs the same code on the CPU, smaller: a trial of the script (ci/check_gpu.sh
--cpu); the goals are the GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import tensorflow as tf

from tf_poseidon import ops

VGG_SHAPES = ((64, 25088, 4096), (64, 4096, 4096), (128, 4096, 1000))
outcomes: list[bool] = []


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}")
    outcomes.append(ok)


def row(what: str, ms: float, rate: str, goal: str = "") -> None:
    print(f"| tf | {what} | {ms:.3f} | {rate} | {goal} |")


def first_tensor(result) -> tf.Tensor:
    return result[0] if isinstance(result, (list, tuple)) else result


def median_ms(fn: Callable[[], object], device: str, calls: int = 10, rounds: int = 5) -> float:
    """Median milliseconds per call of ``fn`` (device work included); checks that ``fn``'s
    result is on ``device``, so that an op placed elsewhere is not timed as the device's."""
    placed = first_tensor(fn())
    assert placed.device.endswith(f"{device}:0"), f"ran on {placed.device}, not {device}"
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        tf.reshape(first_tensor(result), [-1])[:1].numpy()
        per_call.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(per_call)


def bench_pack(device: str, elements: int) -> None:
    count = 50
    sizes = [elements * (i + 1) // count - elements * i // count for i in range(count)]
    shapes = [tf.TensorShape([n]) for n in sizes]
    scale = tf.constant(1 / 64)
    with tf.device(f"/{device}:0"):
        grads = [tf.random.normal([n]) for n in sizes]
        flat = tf.concat(grads, 0)
        memcpy = tf.function(lambda: tf.raw_ops.DeepCopy(x=flat))
        compiled_pack = tf.function(lambda: ops.pack(grads, tf.float16, scale))
        composite_pack = tf.function(
            lambda: ops.CompositeOps.pack(grads, tf.float16, scale))
        wire = compiled_pack()
        compiled_unpack = tf.function(
            lambda: ops.unpack(wire, shapes, [tf.float32] * count, 1 / scale))
        composite_unpack = tf.function(
            lambda: ops.CompositeOps.unpack(wire, shapes, [tf.float32] * count, 1 / scale))
        memcpy_ms = median_ms(memcpy, device)
        times = {name: median_ms(fn, device) for name, fn in [
            ("compiled pack", compiled_pack), ("composite pack", composite_pack),
            ("compiled unpack", compiled_unpack), ("composite unpack", composite_unpack)]}
    memcpy_gbps = 8 * elements / memcpy_ms / 1e6  # float32 read + written
    row(f"memcpy (TF DeepCopy), {4 * elements / 1e9:.2g} GB f32", memcpy_ms,
        f"{memcpy_gbps:.0f} GB/s")
    moved = 6 * elements  # float32 read + float16 written, or the reverse
    for name, ms in times.items():
        gbps = moved / ms / 1e6
        compiled = name.startswith("compiled")
        row(f"{name} f32 <-> f16, {4 * elements / 1e9:.2g} GB f32 in 50 tensors", ms,
            f"{gbps:.0f} GB/s ({100 * gbps / memcpy_gbps:.0f}% of memcpy)",
            ">= 50% of memcpy" if compiled else "")
        if compiled:
            check(gbps >= 0.5 * memcpy_gbps,
                  f"{name}: {100 * gbps / memcpy_gbps:.0f}% of device memcpy (goal >= 50%)")
    speedup = ((times["composite pack"] + times["composite unpack"])
               / (times["compiled pack"] + times["compiled unpack"]))
    row("pack+unpack: composite time / compiled time", 0.0, f"{speedup:.2f}x", ">= 1.5x")
    check(speedup >= 1.5, f"pack+unpack {speedup:.2f}x faster than the composite (goal >= 1.5x)")


def bench_sfb(device: str, shapes) -> None:
    tf32_default = tf.config.experimental.tensor_float_32_execution_enabled()
    for r, m, n in shapes:
        for label, dtype, tf32 in [("f32, tf32", tf.float32, True),
                                   ("f32, exact", tf.float32, False),
                                   ("f16 factors", tf.float16, tf32_default)]:
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
            with tf.device(f"/{device}:0"):
                u = tf.cast(tf.random.normal([r, m]), dtype)
                v = tf.cast(tf.random.normal([r, n]), dtype)
                ours = tf.function(lambda: ops.sfb_reconstruct(u, v, 0.5))
                theirs = tf.function(
                    lambda: ops.CompositeOps.sfb_reconstruct(u, v, tf.constant(0.5)))
                ours_ms, theirs_ms = median_ms(ours, device), median_ms(theirs, device)
            flops = 2 * r * m * n
            what = f"sfb_reconstruct {label}, R={r} M={m} N={n}"
            row(f"{what}: compiled", ours_ms, f"{flops / ours_ms / 1e9:.2f} TFLOP/s",
                "<= 1.1x TF")
            row(f"{what}: TF matmul", theirs_ms, f"{flops / theirs_ms / 1e9:.2f} TFLOP/s")
            check(ours_ms <= 1.1 * theirs_ms,
                  f"{what}: {ours_ms / theirs_ms:.2f}x TF's matmul time (goal <= 1.1x)")
    tf.config.experimental.enable_tensor_float_32_execution(tf32_default)


def sfb_shape(text: str) -> tuple[int, int, int]:
    r, m, n = (int(part) for part in text.split(","))
    return r, m, n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="GPU", choices=["GPU", "CPU"])
    parser.add_argument("--elements", type=int, default=500_000_000,
                        help="float32 elements packed (default 2 GB)")
    parser.add_argument("--sfb-shape", type=sfb_shape, action="append", metavar="R,M,N",
                        help="a GEMM shape to time, repeatable (default the VGG-16 shapes "
                             + " ".join(",".join(map(str, s)) for s in VGG_SHAPES) + ")")
    args = parser.parse_args(argv)
    outcomes.clear()
    if not tf.config.list_physical_devices(args.device):
        print(f"FAIL TensorFlow sees no {args.device}")
        return 1
    if not ops.available():
        print("FAIL compiled ops unavailable")
        return 1
    bench_pack(args.device, args.elements)
    bench_sfb(args.device, args.sfb_shape or VGG_SHAPES)
    print(f"goals: {sum(outcomes)} met, {outcomes.count(False)} missed")
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
