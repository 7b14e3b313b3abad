"""Sufficient factor broadcasting (sfb="auto") against all-reduce (sfb="never") (docs/sfb.md).

On emulated clusters of each --ranks hosts Keras fit trains an FC-heavy model (default:
VGG-16's classifier head 25088→4096→4096→1000, 123.6 M parameters) at --batch rows per rank.
Per configuration: the step time (the slowest rank's median), samples/s, bytes per step and
rank (rank 0's strategy.stats() and its host's eth0 transmit counter), auto / never, and the
plan "auto" made; one process alone (compute only) on the first cluster. With --repeats R
every configuration runs R times, interleaved, and the table shows the run with the median
step time. A benchmark, not a test.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "sfb", {"never": ({}, {"sfb": "never"}), "auto": ({}, {"sfb": "auto"})},
        choices={"model": ["fc", "mlp"]}, ranks=[2, 4], bandwidth="1gbit", steps=4, warmup=2,
        repeats=1, model="fc", width=4096, layers=3, batch=32, no_single=False))
