"""Sufficient factor broadcasting (sfb="auto") against all-reduce (sfb="never") (docs/sfb.md).

    python -m benchmarks.sfb [--ranks 2 4] [--bandwidth 1gbit] [--steps 4] [--warmup 2]
                             [--repeats 1] [--model fc | --model mlp --width 4096 --layers 3]
                             [--no-single] [--json results.json] [--from-json results.json]

On emulated clusters of each --ranks hosts (links shaped to --bandwidth) Keras fit trains an
FC-heavy model (default: VGG-16's classifier head 25088→4096→4096→1000, 123.6 M parameters) at
batch 32 per rank, one compute thread per rank. Per configuration: the step time (the slowest
rank's median), samples/s, bytes per step and rank (rank 0's strategy.stats() and its host's
eth0 transmit counter), and auto / never; one process alone (compute only) on the first
cluster; the plan "auto" made. With --repeats R every configuration runs R times, interleaved,
and the table shows the run with the median step time. A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks import runner


def add_args(p) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default="fc", choices=["fc", "mlp"])
    p.add_argument("--width", type=int, default=4096, help="mlp")
    p.add_argument("--layers", type=int, default=3, help="mlp")
    p.add_argument("--no-single", action="store_true", help="skip the one-process run")


def figures(result: dict, ranks: int, sfb: str) -> dict:
    """One run's figures: step = the slowest rank's median step, rank 0's bytes per step."""
    first = result["per_rank"][0]
    step = max(statistics.median(r["step_times_s"]) for r in result["per_rank"])
    tx = first.get("tx_bytes") if ranks > 1 else None
    return {"ranks": ranks, "sfb": sfb, "step_time_s": step, "samples_per_s": 32 * ranks / step,
            "eth0_tx_bytes_per_step": tx / first["steps"] if tx is not None else None,
            "stats_bytes_sent_per_step": first.get("poseidon_stats", {}).get("bytes_sent"),
            "plan": first.get("plan", "")}


def measure(args, bench: runner.Bench) -> dict:
    model = {"model": args.model, "width": args.width, "layers": args.layers, "batch": 32,
             "warmup": args.warmup, "steps": args.steps}
    out = {"bandwidth": args.bandwidth, "configs": [], "single_runs": []}
    for ranks in args.ranks:
        jobs = {f"P={ranks} sfb={sfb}": runner.Job("poseidon", ranks, model, {"sfb": sfb})
                for sfb in ("never", "auto")}
        if ranks == args.ranks[0] and not args.no_single:
            jobs = {"one process": runner.Job("single", 1, model), **jobs}
        with bench.hosts(ranks, args.bandwidth) as cluster:
            runs = bench.repeat(cluster, jobs, args.repeats)
        out["single_runs"] += [figures(r, 1, "-") for r in runs.pop("one process", [])]
        for (name, results), sfb in zip(runs.items(), ("never", "auto")):
            out["configs"] += [figures(r, ranks, sfb) for r in results]
    return out


def _median(group: list[dict]) -> dict:
    """The run of ``group`` with the median step time."""
    median = statistics.median_low(r["step_time_s"] for r in group)
    return next(r for r in group if r["step_time_s"] == median)


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def table(results: dict) -> list[str]:
    runs: dict = {}
    for r in results["configs"]:
        runs.setdefault((r["ranks"], r["sfb"]), []).append(r)
    chosen = {key: _median(group) for key, group in runs.items()}
    lines = [f"{results['bandwidth']} per host, batch 32 per rank, one compute thread per rank",
             "", "| P | sfb | step (s) | samples/s | MB/step/rank (stats) | MB/step/rank (eth0 "
             "tx) | bytes auto/never | speed-up auto/never | step of each run (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if results["single_runs"]:
        runs[(1, "-")], chosen[(1, "-")] = results["single_runs"], _median(
            results["single_runs"])
    for (ranks, sfb), r in sorted(chosen.items(), key=lambda kv: (kv[0][0] == 1, kv[0])):
        never, ratio, speedup = chosen.get((ranks, "never")), "-", "-"
        if sfb == "auto" and never:
            ratio = f"{r['stats_bytes_sent_per_step'] / never['stats_bytes_sent_per_step']:.2%}"
            if r["eth0_tx_bytes_per_step"] and never["eth0_tx_bytes_per_step"]:
                ratio += (f" (eth0 {r['eth0_tx_bytes_per_step'] / never['eth0_tx_bytes_per_step']"
                          f":.2%})")
            speedup = f"{never['step_time_s'] / r['step_time_s']:.2f}×"
        each = ", ".join(f"{x['step_time_s']:.2f}" for x in runs[(ranks, sfb)])
        lines.append(f"| {ranks if ranks > 1 else '1 (alone)'} | {sfb} | {r['step_time_s']:.3f} "
                     f"| {r['samples_per_s']:.1f} | {_mb(r['stats_bytes_sent_per_step'])} | "
                     f"{_mb(r['eth0_tx_bytes_per_step'])} | {ratio} | {speedup} | {each} |")
    plans = [r for r in results["configs"] if r["sfb"] == "auto" and r["plan"]]
    return lines + [f"\nThe plan of sfb='auto' at P={r['ranks']}:\n{r['plan']}"
                    for r in {r["ranks"]: r for r in plans}.values()]


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, add_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
