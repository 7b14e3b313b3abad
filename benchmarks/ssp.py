"""SSP (staleness 3) against sync, without a straggler and with one rank slowed (docs/ssp.md).

Keras fit of an MLP of three Dense(--width) layers, --batch rows per rank and step, 10 warm-up
and --steps (100) timed steps, on this machine's loopback: sync and mode="ssp", staleness=3,
under each straggler condition: ``none``; ``moving`` — on one step in five one rank sleeps
--delay seconds, rank 0 the first time, then rank 1, ...; ``fixed`` — rank 0 every time.
Throughput runs from the first rank's start of the first timed step to the last rank's end of
the last one. Prints samples/s (median of --repeats) and SSP / sync as the median of the pairs'
ratios (the modes run in turn, so a drift of the machine's speed cancels pair by pair). For a
moving straggler also what a simple model expects: with step time c (sync, no straggler) and
delay d, sync loses d every five steps and SSP d/P (each rank only its own delays), so SSP /
sync = (5c + d) / (5c + d/P). (Where the ranks share cores, a rank whose peer sleeps steps
faster than c, and SSP can do better than that.) A benchmark, not a test.
"""

import statistics
import sys

from benchmarks import report, runner

MODES = {"sync": {"mode": "sync"}, "ssp3": {"mode": "ssp", "staleness": 3}}
STRAGGLERS = {"none": {}, "moving": {"straggler": "moving"}, "fixed": {"straggler": 0}}


def measure(args, bench: runner.Bench) -> dict:
    out = {"delay": args.delay, "batch": args.batch, "rows": []}
    for ranks in args.ranks:
        with bench.hosts(ranks) as cluster:
            for straggler in args.stragglers:
                worker = runner.model_args(args) | STRAGGLERS[straggler] | {
                    "layers": 3, "warmup": 10, "delay": args.delay, "every": 5}
                sync, ssp = bench.repeat(cluster, {f"P={ranks} {straggler} {name}": runner.Job(
                    "poseidon", ranks, worker, mode) for name, mode in MODES.items()},
                    args.repeats).values()
                out["rows"].append({"ranks": ranks, "straggler": straggler,
                                    "sync": [r["span_samples_per_s"] for r in sync],
                                    "ssp3": [r["span_samples_per_s"] for r in ssp]})
    return out


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
    sys.exit(runner.feature_main(__doc__, measure, table, emulated=False,
                                 choices={"stragglers": list(STRAGGLERS)}, ranks=[2, 3],
                                 repeats=3, delay=0.1, stragglers=list(STRAGGLERS), width=1024,
                                 batch=128, steps=100))
