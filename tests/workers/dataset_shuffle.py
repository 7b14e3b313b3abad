"""Worker for the shuffling test: fit on a tf.data pipeline that shuffles.

    dataset_shuffle.py OUT SCENARIO

Scenarios: ``seeded`` (``keras.utils.set_random_seed(5)`` on every rank, ``shuffle`` without
an op seed), ``op_seed`` (no global seed, ``shuffle(n, seed=3)``), ``unseeded`` (neither) and
``different`` (``set_random_seed(5 + rank)``: the ranks' orders would differ). Records the
sample ids of each step of each of 2 epochs (eagerly) in OUT/rank<r>.json, or the error's
message in OUT/rank<r>.error.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402

from shuffle_ids import GLOBAL_BATCH, SAMPLES, NewEpoch, Recorder  # noqa: E402


def main(out: str, scenario: str) -> None:
    if scenario in ("seeded", "different"):
        keras.utils.set_random_seed(5 + (tp.rank() if scenario == "different" else 0))
    x = np.stack([np.arange(SAMPLES), np.ones(SAMPLES)], axis=1).astype("float32")
    y = np.zeros((SAMPLES, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        SAMPLES, seed=3 if scenario == "op_seed" else None).batch(GLOBAL_BATCH)
    strategy = tp.PoseidonStrategy(sfb="never")
    with strategy.scope():
        model = Recorder()
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    try:
        model.fit(dataset, epochs=2, verbose=0, callbacks=[NewEpoch()])
    except ValueError as e:
        with open(os.path.join(out, f"rank{tp.rank()}.error"), "w") as f:
            f.write(str(e))
        return
    with open(os.path.join(out, f"rank{tp.rank()}.json"), "w") as f:
        json.dump({scenario: model.epochs}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
