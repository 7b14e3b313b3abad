"""Worker for the crash test: a large model checkpointed every epoch, to be SIGKILLed mid-save.

    checkpoint_kill.py DIR

Trains a ~134 MB model (two 4096×4096 Dense layers, plain SGD) for 3 epochs with
tp.callbacks.ModelCheckpoint(DIR/model.keras) and tp.callbacks.BackupAndRestore(DIR/backup).
After each epoch's saves, writes DIR/epoch<e>.json with every variable's float64 sum (what the
checkpoint of that epoch must hold). The test kills the process while the second epoch's
model.keras is being written.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402

WIDTH = 4096


def weight_sums(model: keras.Model) -> list[float]:
    return [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights]


class RecordSums(keras.callbacks.Callback):
    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        path = os.path.join(self.directory, f"epoch{epoch + 1}.json")
        with open(path + ".part", "w") as f:
            json.dump(weight_sums(self.model), f)
        os.replace(path + ".part", path)


def main():
    directory = sys.argv[1]
    keras.utils.set_random_seed(0)
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH),
                                  keras.layers.Dense(WIDTH), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, WIDTH)).astype("float32")
    y = np.zeros((8, 1), "float32")
    callbacks = [tp_callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")),
                 tp_callbacks.BackupAndRestore(os.path.join(directory, "backup")),
                 RecordSums(directory)]
    model.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks, verbose=0)


if __name__ == "__main__":
    sys.exit(main())
