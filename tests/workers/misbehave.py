"""Worker for the failure and logging tests: a short fit in which one rank misbehaves.

    misbehave.py raise          rank 1 raises in the 4th training batch
    misbehave.py mismatch       rank 1 builds a wider hidden layer than rank 0
    misbehave.py outside_scope  the model is built outside strategy.scope() (compiled inside)
    misbehave.py verbose        nobody misbehaves; fit, evaluate and predict print their progress
                                bars (verbose=1); then a model under no strategy is fit (each
                                rank trains its own copy: rank 0 warns)
    misbehave.py hang           rank 1 stops for 600 s before its 4th training batch (alive, stuck)
"""

import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402


class HangOnRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == 1 and batch == 3:
            time.sleep(600)


class RaiseOnRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == 1 and batch == 3:
            raise RuntimeError("injected failure on rank 1")


def main(behaviour: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 10)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    width = 24 if behaviour == "mismatch" and tp.rank() == 1 else 16
    strategy = tp.PoseidonStrategy()
    build_scope = contextlib.nullcontext() if behaviour == "outside_scope" else strategy.scope()
    with build_scope:
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(2)])
    with strategy.scope():
        model.compile(optimizer="sgd", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = {"raise": [RaiseOnRankOne()], "hang": [HangOnRankOne()]}.get(behaviour, [])
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=1 if behaviour == "verbose" else 0,
                        callbacks=callbacks)
    if behaviour == "verbose":
        model.evaluate(x, y, batch_size=64, verbose=1)
        model.predict(x, batch_size=64, verbose=1)
        alone = keras.Sequential([keras.Input((10,)), keras.layers.Dense(2)])
        alone.compile(optimizer="sgd", loss="mse")
        alone.fit(x, x[:, :2], batch_size=64, epochs=1, verbose=0)
    print(f"rank {tp.rank()} final loss {history.history['loss'][-1]:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
