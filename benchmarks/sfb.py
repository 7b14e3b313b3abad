"""Sufficient factor broadcasting (sfb="auto") against all-reduce (sfb="never") on VGG-16's
classifier head, per number of emulated hosts, with one process alone for reference; docs/sfb.md
("Benchmark") describes the set-up and each column. A benchmark, not a test.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "sfb", {"never": ({}, {"sfb": "never"}), "auto": ({}, {"sfb": "auto"})},
        model="fc", ranks=[2, 4], bandwidth="1gbit", batch=32, warmup=2, steps=4, repeats=1))
