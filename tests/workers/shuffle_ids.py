"""Worker for the shuffling test: which samples each rank trains on, per epoch.

    shuffle_ids.py OUT

Trains a tiny model with ``fit(x, y, shuffle=True)`` (eagerly, so each step can record the ids
in its batch) three times: unseeded, then twice after ``keras.utils.set_random_seed`` (rank 0's
seed decides; the other ranks seed differently on purpose). Writes OUT/rank<r>.json: per fit,
per epoch, the list of this rank's per-step id lists.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402

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


def fit_once(strategy) -> list:
    x = np.stack([np.arange(SAMPLES), np.ones(SAMPLES)], axis=1).astype("float32")
    y = np.zeros((SAMPLES, 1), "float32")
    with strategy.scope():
        model = Recorder()
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
              callbacks=[NewEpoch()])
    return model.epochs


def main(out: str) -> None:
    # sfb="never": SFB's capture of Dense layers fails in eagerly run steps (a separate bug).
    strategy = tp.PoseidonStrategy(sfb="never")
    fits = {"unseeded": fit_once(strategy)}
    for name in ("seeded", "seeded_again"):
        keras.utils.set_random_seed(7 + 1000 * tp.rank())
        fits[name] = fit_once(strategy)
    fits["seeded_next"] = fit_once(strategy)
    with open(os.path.join(out, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(fits, f)


if __name__ == "__main__":
    main(sys.argv[1])
