"""Worker for the cross-replica collectives of the tf.distribute API, eager and in tf.function:

    cross_replica.py OUT

strategy.reduce (SUM, MEAN) of scalars and vectors, strategy.gather of rows that differ in
number per rank (float32 and bfloat16), and a replica context's all_gather. Writes
OUT/rank<r>.json.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402


def collectives(strategy: tp.PoseidonStrategy) -> dict:
    r = float(tp.rank())
    rows = tf.fill([tp.rank() + 1, 2], r)  # rank r has r + 1 rows of r
    return {
        "sum_scalar": strategy.reduce("SUM", tf.constant(r + 1.0), axis=None),
        "mean_vector": strategy.reduce("MEAN", tf.constant([r, 2.0 * r, 3.0]), axis=None),
        "sum_float64": strategy.reduce("SUM", tf.constant([r], tf.float64), axis=None),
        "gather_rows": strategy.gather(rows, axis=0),
        "gather_bfloat16": tf.cast(strategy.gather(tf.cast(rows, tf.bfloat16), axis=0),
                                   tf.float32),
        "all_gather": strategy.run(
            lambda: tf.distribute.get_replica_context().all_gather(tf.constant([[r]]), axis=1)),
    }


def main(out: str) -> None:
    strategy = tp.PoseidonStrategy()
    report = {}
    for how, fn in [("eager", lambda: collectives(strategy)),
                    ("function", tf.function(lambda: collectives(strategy)))]:
        report[how] = {k: v.numpy().tolist() for k, v in fn().items()}
    with open(os.path.join(out, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
