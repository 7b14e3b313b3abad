"""What collective agreement (tf_poseidon/comm/agreement.py) costs: 2000 checks alone, then an
MLP's Keras fit with the checks and with them replaced by a no-op, --rounds times interleaved,
on this machine's loopback (docs/failures.md). Prints the check's time, each round's step times
and the median ratio with / without.
"""

import statistics
import sys

from benchmarks import report, runner


def measure(args, bench: runner.Bench) -> dict:
    model = runner.model_args(args) | {"layers": 3}
    with bench.hosts(args.ranks) as cluster:
        [check] = bench.repeat(cluster, {"2000 checks": runner.Job(
            "agreement", args.ranks, {"repeats": 2000}, launch="launcher")})["2000 checks"]
        on, off = bench.repeat(cluster, {
            "checks on": runner.Job("poseidon", args.ranks, model),
            "checks off": runner.Job("poseidon", args.ranks, model | {"no_agreement": True})},
            args.rounds).values()
    return {"ranks": args.ranks, "check_s": max(r["check_s"] for r in check["per_rank"]),
            "on_s": [r["step_s"] for r in on], "off_s": [r["step_s"] for r in off]}


def table(results: dict) -> list[str]:
    pairs = list(zip(results["on_s"], results["off_s"]))
    return [f"one check: {results['check_s'] * 1e6:.1f} µs ({results['ranks']} ranks)", "",
            *report.table(["round", "step with checks (ms)", "step without (ms)", "ratio"], [
                [i + 1, f"{on * 1e3:.2f}", f"{off * 1e3:.2f}", f"{on / off:.4f}"]
                for i, (on, off) in enumerate(pairs)]),
            "", f"median ratio with/without: {statistics.median(a / b for a, b in pairs):.4f}"]


if __name__ == "__main__":
    sys.exit(runner.feature_main(__doc__, measure, table, emulated=False, ranks=2, width=512,
                                 batch=512, steps=40, warmup=4, rounds=6))
