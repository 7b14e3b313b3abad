"""Worker for the shuffling test: which samples each rank trains on, per epoch.

    shuffle_ids.py OUT [--one-process]

Trains a tiny model (eagerly, so each step can record the ids in its batch) on each source:
``arrays`` (``fit(x, y, shuffle=True)``), ``pydataset`` (``fit(py_dataset)`` of global batches,
shuffled by default) and ``pydataset_threads`` (the same PyDataset with 2 workers: Keras'
enqueuer), each four times: unseeded, twice after ``keras.utils.set_random_seed`` (rank 0's
seed decides; the other ranks seed differently on purpose, Python's ``random`` included), and
once more. Then, with the global seed cleared again, a tf.data pipeline that shuffles
(``dataset/<scenario>``): ``unseeded`` (no global seed, no op seed), ``sampled``
(``Dataset.sample_from_datasets`` of the even and odd ids, no seed), ``unordered`` (the
``op_seed`` pipeline, then a parallel ``map`` with ``deterministic=False``), ``op_seed`` (no
global seed, ``shuffle(n, seed=3)``), ``different`` (``keras.utils.set_random_seed(5 +
rank)``: the ranks' orders would differ) and ``seeded`` (``set_random_seed(5)`` on every rank,
no op seed).
Writes OUT/rank<r>.json: per source and fit (``<source>/<fit>``), per epoch, the list of this
rank's per-step id lists; for a fit that raised, ``{"error": its message}``.
``--one-process``: the same fits in plain Keras (its default strategy, seeded as rank 0),
written as OUT/rank0.json: the order one process trains in.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from global_batches import GlobalBatches  # noqa: E402

SAMPLES = 96
GLOBAL_BATCH = 16
EPOCHS = 2


class Recorder(keras.Model):
    """A linear model whose train step records the sample ids (feature 0) of its batch."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.epochs: list[list[list[int]]] = []

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, _ = data
        self.epochs[-1].append([int(i) for i in x.numpy()[:, 0]])
        return super().train_step(data)


class NewEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.model.epochs.append([])


def fit_once(strategy, source: str) -> list | dict:
    """The ids of each step of each epoch of a fit on ``source``; a dataset's scenario
    (``dataset/<scenario>``) that fit refuses gives ``{"error": message}``."""
    x = np.stack([np.arange(SAMPLES), np.ones(SAMPLES)], axis=1).astype("float32")
    y = np.zeros((SAMPLES, 1), "float32")
    with strategy.scope():
        model = Recorder()
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    if source == "dataset/sampled":
        inputs = {"x": tf.data.Dataset.sample_from_datasets([
            tf.data.Dataset.from_tensor_slices((x[start::2], y[start::2])) for start in (0, 1)
        ]).batch(GLOBAL_BATCH)}
    elif source.startswith("dataset/"):
        rows = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            SAMPLES, seed=3 if source in ("dataset/op_seed", "dataset/unordered") else None)
        if source == "dataset/unordered":
            rows = rows.map(lambda *row: row, num_parallel_calls=2, deterministic=False)
        inputs = {"x": rows.batch(GLOBAL_BATCH)}
    else:
        inputs = ({"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": True}
                  if source == "arrays" else
                  {"x": GlobalBatches(x, y, GLOBAL_BATCH,
                                     workers=2 if source == "pydataset_threads" else 1)})
    try:
        model.fit(**inputs, epochs=EPOCHS, verbose=0, callbacks=[NewEpoch()])
    except ValueError as e:
        if not source.startswith("dataset/"):
            raise
        return {"error": str(e)}
    return model.epochs


def main(out: str, one_process: bool) -> None:
    strategy = tf.distribute.get_strategy() if one_process else tp.PoseidonStrategy()
    fits = {}
    for source in ("arrays", "pydataset", "pydataset_threads"):
        fits[f"{source}/unseeded"] = fit_once(strategy, source)
        for name in ("seeded", "seeded_again"):
            keras.utils.set_random_seed(7 + 1000 * tp.rank())
            fits[f"{source}/{name}"] = fit_once(strategy, source)
        fits[f"{source}/seeded_next"] = fit_once(strategy, source)
    tf.random.set_seed(None)  # no global seed: a tf.data shuffle without an op seed is unseeded
    for scenario in ("unseeded", "sampled", "unordered", "op_seed", "different", "seeded"):
        if scenario in ("different", "seeded"):
            keras.utils.set_random_seed(5 + (tp.rank() if scenario == "different" else 0))
        fits[f"dataset/{scenario}"] = fit_once(strategy, f"dataset/{scenario}")
    with open(os.path.join(out, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(fits, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["--one-process"])
