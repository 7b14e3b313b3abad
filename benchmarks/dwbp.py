"""Wait-free backprop (overlap=True) against communicating after the backward pass
(docs/dwbp.md).

    python -m benchmarks.dwbp [--bandwidth 1gbit] [--repeats 3] [--bucket-mb 4 ...]
                              [--width 2048] [--layers 6] [--batch 256] [--warmup 3] [--steps 9]

On 2 emulated hosts (links shaped to --bandwidth) Keras fit trains an MLP of --layers
Dense(--width) whose gradient all-reduce takes about as long as its backward pass. Per bucket
size, overlap=True and overlap=False run --repeats times, interleaved; one process alone gives
the compute-only step. Prints per bucket the median step time (rank 0's timed steps, median
over the repeats), overlap / naive, the communication time per step and the fraction of it
hidden behind the backward pass (strategy.stats()). A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks import runner


def add_args(p) -> None:
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[4.0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=256, help="rows per rank per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=9, help="timed steps")


def median_step(result: dict) -> float:
    return statistics.median(result["per_rank"][0]["step_times_s"])


def measure(args, bench: runner.Bench) -> dict:
    model = {"model": "mlp", "width": args.width, "layers": args.layers, "batch": args.batch,
             "warmup": args.warmup, "steps": args.steps}
    out = {"bandwidth": args.bandwidth, "buckets": []}
    with bench.hosts(2, args.bandwidth) as cluster:
        single = bench.repeat(cluster, {"one process": runner.Job("single", 1, model)},
                              args.repeats)["one process"]
        out["single_s"] = statistics.median(map(median_step, single))
        for mb in args.bucket_mb:
            options = {"bucket_bytes": int(mb * 2**20)}
            runs = bench.repeat(cluster, {
                f"{mb:g} MB, overlap": runner.Job("poseidon", 2, model, options),
                f"{mb:g} MB, overlap=False": runner.Job("poseidon", 2, model,
                                                        {**options, "overlap": False})},
                args.repeats)
            overlap, naive = runs.values()
            stats = [r["per_rank"][0]["poseidon_stats"] for r in overlap]
            out["buckets"].append({
                "bucket_mb": mb, "overlap_s": statistics.median(map(median_step, overlap)),
                "naive_s": statistics.median(map(median_step, naive)),
                "hidden": statistics.median(s["hidden_fraction"] for s in stats),
                "comm_s": stats[-1]["comm_time_s"]})
    return out


def table(results: dict) -> list[str]:
    lines = [f"2 hosts at {results['bandwidth']}; compute-only step {results['single_s']:.3f} s",
             "", "| bucket MB | step, overlap (s) | step, overlap=False (s) | overlap / naive | "
             "comm time (s) | comm hidden |", "|---|---|---|---|---|---|"]
    for b in results["buckets"]:
        lines.append(f"| {b['bucket_mb']:g} | {b['overlap_s']:.3f} | {b['naive_s']:.3f} | "
                     f"{b['overlap_s'] / b['naive_s']:.2f} | {b['comm_s']:.3f} | "
                     f"{b['hidden']:.0%} |")
    return lines


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, add_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
