"""Sparse embedding gradients gathered as rows against the dense all-reduce of the whole table
(docs/synchronization.md).

On emulated clusters of each --ranks hosts Keras fit trains the ``embedding`` model
(benchmarks/models.py: Embedding(1_000_000, 64), 8 ids per example, then an MLP) with SGD.
``sparse``: tf_poseidon's default (the plan gathers the rows each rank looked up); ``dense``:
every gradient made dense before the optimizer applies it (Horovod's ``sparse_as_dense``: the
table's 256 MB all-reduced every step). Prints what benchmarks/sfb.py prints, sparse / dense.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "gradients", {"dense": ({"dense_gradients": True}, {}), "sparse": ({}, {})},
        model="embedding", ranks=[2], bandwidth="1gbit", batch=256, warmup=2, steps=6,
        repeats=3))
