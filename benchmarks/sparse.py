"""Sparse embedding gradients gathered as rows against the dense all-reduce of the whole table
(docs/synchronization.md).

On emulated clusters of each --ranks hosts Keras fit trains the ``embedding`` model
(benchmarks/models.py: Embedding(1_000_000, 64), 8 ids per example, then an MLP) with SGD at
--batch rows per rank. ``sparse``: tf_poseidon's default (the per-layer plan gathers the rows
each rank looked up); ``dense``: the same with every gradient made dense before the optimizer
applies it (Horovod's ``sparse_as_dense``: the table's 256 MB all-reduced every step). Per
configuration the step time, bytes per step and rank (strategy.stats() and the host's eth0
counter), sparse / dense, and the plan. A benchmark, not a test.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "gradients", {"dense": ({"dense_gradients": True}, {}), "sparse": ({}, {})},
        choices={"model": ["embedding"]}, ranks=[2], bandwidth="1gbit", steps=6, warmup=2,
        repeats=3, model="embedding", batch=256, no_single=False))
