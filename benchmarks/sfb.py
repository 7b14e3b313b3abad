"""Sufficient factor broadcasting (sfb="auto") against all-reduce (sfb="never") (docs/sfb.md).

On emulated clusters of each --ranks hosts Keras fit trains VGG-16's classifier head
(25088→4096→4096→1000, 123.6 M parameters) at --batch rows per rank; one process alone on the
first cluster. Prints per world size and configuration the step time (the slowest rank's
median), samples/s, bytes per step and rank (strategy.stats() and eth0), auto / never, and the
plan "auto" made (runner.versus). A benchmark, not a test.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "sfb", {"never": ({}, {"sfb": "never"}), "auto": ({}, {"sfb": "auto"})},
        model="fc", ranks=[2, 4], bandwidth="1gbit", batch=32, warmup=2, steps=4, repeats=1))
