"""Sufficient factor broadcasting (sfb="auto") against all-reduce (sfb="never") (docs/sfb.md).

    python -m benchmarks.sfb [--ranks 2 4] [--bandwidth 1gbit] [--steps 4] [--warmup 2]
                             [--repeats 1] [--model fc | --model mlp --width 4096 --layers 3]
                             [--no-single] [--json results.json] [--from-json results.json]

On emulated clusters of each --ranks hosts Keras fit trains an FC-heavy model (default:
VGG-16's classifier head 25088→4096→4096→1000, 123.6 M parameters) at batch 32 per rank. Per
configuration: the step time (the slowest rank's median), samples/s, bytes per step and rank
(rank 0's strategy.stats() and its host's eth0 transmit counter), auto / never, and the plan
"auto" made; one process alone (compute only) on the first cluster. With --repeats R every
configuration runs R times, interleaved, and the table shows the run with the median step
time. A benchmark, not a test.
"""

import statistics
import sys

from benchmarks import runner


def figures(result: dict, ranks: int, sfb: str) -> dict:
    first = result["per_rank"][0]
    step = max(statistics.median(r["step_times_s"]) for r in result["per_rank"])
    tx = first.get("tx_bytes") if ranks > 1 else None
    return {"ranks": ranks, "sfb": sfb, "step_time_s": step, "samples_per_s": 32 * ranks / step,
            "eth0_tx_bytes_per_step": None if tx is None else tx / first["steps"],
            "stats_bytes_sent_per_step": first.get("poseidon_stats", {}).get("bytes_sent"),
            "plan": first.get("plan", "")}


def measure(args, bench: runner.Bench) -> dict:
    model = runner.model_args(args) | {"batch": 32}
    out = {"bandwidth": args.bandwidth, "runs": []}
    for ranks in args.ranks:
        jobs = {("never", ranks): runner.Job("poseidon", ranks, model, {"sfb": "never"}),
                ("auto", ranks): runner.Job("poseidon", ranks, model, {"sfb": "auto"})}
        if ranks == args.ranks[0] and not args.no_single:
            jobs = {("-", 1): runner.Job("single", 1, model)} | jobs
        with bench.hosts(ranks, args.bandwidth) as cluster:
            runs = bench.repeat(cluster, {f"P={p} sfb={s}": job for (s, p), job in jobs.items()},
                                args.repeats)
        out["runs"] += [figures(r, p, s) for (s, p), rs in zip(jobs, runs.values()) for r in rs]
    return out


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def table(results: dict) -> list[str]:
    runs: dict = {}
    for r in results["runs"]:
        runs.setdefault((r["ranks"] == 1, r["ranks"], r["sfb"]), []).append(r)
    chosen = {key: next(r for r in group if r["step_time_s"] == statistics.median_low(
        x["step_time_s"] for x in group)) for key, group in runs.items()}
    lines = [f"{results['bandwidth']} per host, batch 32 per rank, one compute thread per rank",
             "", "| P | sfb | step (s) | samples/s | MB/step/rank (stats) | MB/step/rank (eth0 "
             "tx) | bytes auto/never | speed-up auto/never | step of each run (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (alone, ranks, sfb), r in sorted(chosen.items()):
        never, ratio, speedup = chosen.get((False, ranks, "never")), "-", "-"
        if sfb == "auto" and never:
            ratio = f"{r['stats_bytes_sent_per_step'] / never['stats_bytes_sent_per_step']:.2%}"
            if r["eth0_tx_bytes_per_step"] and never["eth0_tx_bytes_per_step"]:
                eth0 = r["eth0_tx_bytes_per_step"] / never["eth0_tx_bytes_per_step"]
                ratio += f" (eth0 {eth0:.2%})"
            speedup = f"{never['step_time_s'] / r['step_time_s']:.2f}×"
        each = ", ".join(f"{x['step_time_s']:.2f}" for x in runs[(alone, ranks, sfb)])
        lines.append(f"| {'1 (alone)' if alone else ranks} | {sfb} | {r['step_time_s']:.3f} | "
                     f"{r['samples_per_s']:.1f} | {_mb(r['stats_bytes_sent_per_step'])} | "
                     f"{_mb(r['eth0_tx_bytes_per_step'])} | {ratio} | {speedup} | {each} |")
    return lines + [f"\nThe plan of sfb='auto' at P={r['ranks']}:\n{r['plan']}"
                    for (_, _, sfb), r in sorted(chosen.items()) if sfb == "auto" and r["plan"]]


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, measure, table, choices={"model": ["fc", "mlp"]},
                               ranks=[2, 4], bandwidth="1gbit", steps=4, warmup=2, repeats=1,
                               model="fc", width=4096, layers=3, no_single=False)


if __name__ == "__main__":
    sys.exit(main())
