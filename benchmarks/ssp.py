"""SSP (staleness 3) against sync on this machine's loopback, with no straggler, a moving one
(one step in five a rank sleeps --delay s: rank 0, then 1, ...) or a fixed one (rank 0)
(docs/ssp.md): samples/s of each (median of --repeats), SSP / sync as the median of the pairs'
ratios, and for a moving straggler the model (5c + d) / (5c + d/P), c the sync step, d the delay.
"""

import statistics
import sys

from benchmarks import report, runner

MODES = {"sync": {"mode": "sync"}, "ssp3": {"mode": "ssp", "staleness": 3}}
STRAGGLERS = {"none": {}, "moving": {"straggler": "moving"}, "fixed": {"straggler": 0}}


def measure(args, bench: runner.Bench) -> dict:
    rows = []
    for ranks in args.ranks:
        with bench.hosts(ranks) as cluster:
            for straggler in args.stragglers:
                worker = runner.model_args(args) | STRAGGLERS[straggler] | {
                    "layers": 3, "warmup": 10, "delay": args.delay, "every": 5}
                runs = bench.repeat(cluster, {f"P={ranks} {straggler} {name}": runner.Job(
                    "poseidon", ranks, worker, mode) for name, mode in MODES.items()},
                    args.repeats)
                rows.append({"ranks": ranks, "straggler": straggler} | {
                    name: [r["span_samples_per_s"] for r in results]
                    for name, results in zip(MODES, runs.values())})
    return {"delay": args.delay, "batch": args.batch, "rows": rows}


def table(results: dict) -> list[str]:
    rows, step_s, d = [], {}, results["delay"]
    for row in results["rows"]:
        p, sync, ssp = row["ranks"], row["sync"], row["ssp3"]
        ratios = [b / a for a, b in zip(sync, ssp)]
        if row["straggler"] == "none":
            step_s[p] = p * results["batch"] / statistics.median(sync)
        c = step_s.get(p) if row["straggler"] == "moving" else None
        rows.append([p, row["straggler"], f"{statistics.median(sync):.0f}",
                     f"{statistics.median(ssp):.0f}", f"{statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}–{max(ratios):.2f})",
                     "–" if c is None else f"{(5 * c + d) / (5 * c + d / p):.2f}"])
    return report.table(["ranks", "straggler", "sync (samples/s)", "SSP s=3 (samples/s)",
                         "SSP / sync (pairs: min–max)", "model"], rows)


if __name__ == "__main__":
    sys.exit(runner.feature_main(__doc__, measure, table, emulated=False, ranks=[2, 3],
                                 repeats=3, delay=0.1, stragglers=list(STRAGGLERS), width=1024,
                                 batch=128, steps=100))
