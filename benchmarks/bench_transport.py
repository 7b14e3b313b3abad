"""Benchmark: fp16/bf16 compressed all-reduce vs float32, 2 emulated hosts.

    python -m benchmarks.bench_transport [--bandwidth 1gbit] [--megabytes 64] [--repeats 5]

Runs benchmarks/workers/transport_worker.py on a tf_poseidon.testing.EmulatedCluster (one
network namespace per host, links shaped to --bandwidth; "none": unshaped) and prints the median
time of one all-reduce of --megabytes of float32 for each wire format, the speed-ups, and each
format's floor (its bytes per rank over the link rate). A benchmark, not a test: the figures
depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.report import rate_bits
from tf_poseidon.comm import codecs
from tf_poseidon.testing import emulated_cluster

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "transport_worker.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--megabytes", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    ok, reason = emulated_cluster.available()
    if not ok:
        print(f"emulated cluster not available ({reason}); this benchmark needs it")
        return 1
    bandwidth = None if args.bandwidth == "none" else args.bandwidth
    with emulated_cluster.EmulatedCluster(2, bandwidth) as cluster:
        argv = [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(1),
                sys.executable, WORKER, str(args.megabytes), str(args.repeats)]
        result = cluster.run(argv, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-3000:], result.stderr[-3000:])
        return 1
    times = json.loads(lines[-1][len("RESULT "):])
    print(f"2 hosts at {args.bandwidth}, one all-reduce of {args.megabytes:g} MB of float32 "
          f"(median of {args.repeats})\n")
    link = rate_bits(bandwidth)
    payload = args.megabytes * 2**20
    sent = {name: codecs.get(codec).wire_bytes(payload // 4, 2)[0]
            for name, codec in (("fp32", "none"), ("fp16", "fp16"), ("bf16", "bf16"))}
    print("| wire format | time (s) | speed-up vs fp32 | MB sent per rank | floor (s) |\n"
          "|---|---|---|---|---|")
    for name, seconds in times.items():
        floor = f"{8 * sent[name] / link:.3f}" if link else "—"
        print(f"| {name} | {seconds:.3f} | {times['fp32'] / seconds:.2f}× "
              f"| {sent[name] / 1e6:.1f} | {floor} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
