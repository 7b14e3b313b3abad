"""Sparse embedding gradients gathered as rows (tf_poseidon's default) against the densified
gradient all-reduced (Horovod's ``sparse_as_dense``) on an Embedding(1M, 64) model, per number
of emulated hosts; docs/synchronization.md describes the set-up and each column.
"""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.versus_main(
        __doc__, "gradients", {"dense": ({"dense_gradients": True}, {}), "sparse": ({}, {})},
        model="embedding", ranks=[2], bandwidth="1gbit", batch=256, warmup=2, steps=6,
        repeats=3))
