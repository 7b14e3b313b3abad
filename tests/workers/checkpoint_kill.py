"""Worker for the kill drills: a model checkpointed every epoch, whose ranks are SIGKILLed.

    checkpoint_kill.py DIR [--width W] [--arm forward|collective]

Every rank writes DIR/pid_rank<r> (its process id) and trains a model of two W×W Dense layers
(W=4096, the default: ~134 MB, so that a save takes long enough to be caught) for 3 epochs of
one step, plain SGD, with tp.callbacks.ModelCheckpoint(DIR/model.keras) and
tp.callbacks.BackupAndRestore(DIR/backup). At the end of each epoch, before the saves, rank 0
writes DIR/epoch<e>.json with every variable's float64 sum (what that epoch's checkpoint
holds). Runs as one process too (then it is rank 0).

* ``--arm forward``: in epoch 2's forward pass rank 1 writes DIR/killing and SIGKILLs itself.
* ``--arm collective``: in epoch 2's forward pass rank 0 writes DIR/rank0_forward and sleeps
  8 s, rank 1 writes DIR/rank1_forward and goes on into the step's gradient all-reduce, where
  it waits for rank 0: the test kills it there.
* no ``--arm``: the test kills a rank while rank 0 writes epoch 2's model.keras (while
  DIR/.tp-tmp-<rank 0's pid>-model.keras exists).
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402

ARMED_EPOCH = 1  # 0-based: the second epoch


def weight_sums(model: keras.Model) -> list[float]:
    return [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights]


def write_atomically(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


class RecordSums(keras.callbacks.Callback):
    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def on_epoch_begin(self, epoch, logs=None):
        Tripwire.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if tp.is_chief():
            write_atomically(os.path.join(self.directory, f"epoch{epoch + 1}.json"),
                             json.dumps(weight_sums(self.model)))


@keras.saving.register_keras_serializable(package="kill_drill")
class Tripwire(keras.layers.Layer):
    """Identity whose forward pass, in the armed epoch, does what ``--arm`` says. (A process
    that loads a checkpoint imports this module first, for the class.)"""

    epoch = 0

    def __init__(self, directory: str, arm: str | None, **kwargs):
        super().__init__(**kwargs)
        self.directory, self.arm = directory, arm

    def _trip(self, x: np.ndarray) -> np.ndarray:
        if self.arm is None or Tripwire.epoch != ARMED_EPOCH:
            return x
        mark = os.path.join(self.directory, f"rank{tp.rank()}_forward")
        if self.arm == "forward" and tp.rank() == 1:
            write_atomically(os.path.join(self.directory, "killing"), str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.arm == "collective":
            write_atomically(mark, str(time.time()))
            if tp.rank() == 0:
                time.sleep(8)
        return x

    def get_config(self):
        return {**super().get_config(), "directory": self.directory, "arm": self.arm}

    def call(self, x):
        y = tf.numpy_function(self._trip, [x], x.dtype, stateful=True, name="tripwire")
        y.set_shape(x.shape)
        return y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--arm", choices=["forward", "collective"])
    args = parser.parse_args()
    directory, width = args.directory, args.width
    write_atomically(os.path.join(directory, f"pid_rank{tp.rank()}"), str(os.getpid()))
    keras.utils.set_random_seed(0)
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,)), Tripwire(directory, args.arm),
                                  keras.layers.Dense(width), keras.layers.Dense(width),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, width)).astype("float32")
    y = np.zeros((8, 1), "float32")
    callbacks = [RecordSums(directory),
                 tp_callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")),
                 tp_callbacks.BackupAndRestore(os.path.join(directory, "backup"))]
    model.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks, verbose=0)


if __name__ == "__main__":
    sys.exit(main())
