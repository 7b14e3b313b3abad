"""Wait-free backprop (overlap=True) against communicating after the backward pass
(docs/dwbp.md).

On 2 emulated hosts Keras fit trains an MLP of --layers Dense(--width) whose gradient
all-reduce takes about as long as its backward pass. Per bucket size, overlap=True and
overlap=False run --repeats times, interleaved; one process alone gives the compute-only step.
Prints per bucket the median step time (rank 0's timed steps, then the median over the
repeats), overlap / naive, the communication time per step and the fraction of it hidden behind
the backward pass (strategy.stats()). A benchmark, not a test.
"""

import statistics
import sys

from benchmarks import report, runner


def median_step(runs: list[dict]) -> float:
    return statistics.median(statistics.median(r["per_rank"][0]["step_times_s"]) for r in runs)


def measure(args, bench: runner.Bench) -> dict:
    model, out = runner.model_args(args), {"bandwidth": args.bandwidth, "buckets": []}
    with bench.hosts(2, args.bandwidth) as cluster:
        single = bench.repeat(cluster, {"one process": runner.Job("single", 1, model)},
                              args.repeats)
        out["single_s"] = median_step(single["one process"])
        for mb in args.bucket_mb:
            options = {"bucket_bytes": int(mb * 2**20)}
            overlap, naive = bench.repeat(cluster, {
                f"{mb:g} MB, overlap": runner.Job("poseidon", 2, model, options),
                f"{mb:g} MB, overlap=False": runner.Job("poseidon", 2, model,
                                                        options | {"overlap": False})},
                args.repeats).values()
            stats = [r["per_rank"][0]["poseidon_stats"] for r in overlap]
            out["buckets"].append({
                "bucket_mb": mb, "overlap_s": median_step(overlap), "naive_s": median_step(naive),
                "hidden": statistics.median(s["hidden_fraction"] for s in stats),
                "comm_s": stats[-1]["comm_time_s"]})
    return out


def table(results: dict) -> list[str]:
    return [f"2 hosts at {results['bandwidth']}; compute-only step {results['single_s']:.3f} s",
            "", *report.table(["bucket MB", "step, overlap (s)", "step, overlap=False (s)",
                               "overlap / naive", "comm time (s)", "comm hidden"], [
                [f"{b['bucket_mb']:g}", f"{b['overlap_s']:.3f}", f"{b['naive_s']:.3f}",
                 f"{b['overlap_s'] / b['naive_s']:.2f}", f"{b['comm_s']:.3f}",
                 f"{b['hidden']:.0%}"] for b in results["buckets"]])]


if __name__ == "__main__":
    sys.exit(runner.feature_main(__doc__, measure, table, bandwidth="1gbit", repeats=3,
                                 bucket_mb=[4.0], width=2048, layers=6, batch=256, warmup=3,
                                 steps=9))
