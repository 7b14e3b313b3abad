"""Wait-free backprop (overlap=True) against communicating after the backward pass, per bucket
size, on 2 emulated hosts (docs/dwbp.md): the median step of each (rank 0's timed steps, then
over --repeats interleaved runs), their ratio, the communication time per step and the share of
it hidden behind the backward pass (strategy.stats()); one process alone gives the compute.
"""

import statistics
import sys

from benchmarks import report, runner


def measure(args, bench: runner.Bench) -> dict:
    model, jobs = runner.model_args(args), {"one process": runner.Job("single", 1,
                                                                      runner.model_args(args))}
    for mb in args.bucket_mb:
        options = {"bucket_bytes": int(mb * 2**20)}
        jobs[f"{mb:g} MB, overlap"] = runner.Job("poseidon", 2, model, options)
        jobs[f"{mb:g} MB, overlap=False"] = runner.Job("poseidon", 2, model,
                                                       options | {"overlap": False})
    with bench.hosts(2, args.bandwidth) as cluster:
        runs = bench.repeat(cluster, jobs, args.repeats)
    step = {name: statistics.median(statistics.median(r["per_rank"][0]["step_times_s"])
                                    for r in results) for name, results in runs.items()}
    stats = {mb: [r["per_rank"][0]["poseidon_stats"] for r in runs[f"{mb:g} MB, overlap"]]
             for mb in args.bucket_mb}
    return {"bandwidth": args.bandwidth, "single_s": step["one process"], "buckets": [{
        "bucket_mb": mb, "overlap_s": step[f"{mb:g} MB, overlap"],
        "naive_s": step[f"{mb:g} MB, overlap=False"], "comm_s": stats[mb][-1]["comm_time_s"],
        "hidden": statistics.median(s["hidden_fraction"] for s in stats[mb])}
        for mb in args.bucket_mb]}


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
