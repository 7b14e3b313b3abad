"""Worker for tests/test_multihost.py: trains "forever", checkpointing every epoch.

    multihost_lose.py OUT

Every rank writes OUT/pid_rank<r> (its process id, for the test to SIGKILL) and then trains a
small MLP for up to EPOCHS epochs of 10 steps with tp.callbacks.ModelCheckpoint(OUT/model.keras)
(rank 0 writes, atomically). Prints "rank <r> epoch <e>" after each epoch. The test kills a
rank or cuts a host's link once the first checkpoint exists; the surviving ranks must then
end the job, not hang.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402

EPOCHS = 100000
ROWS = 600
GLOBAL_BATCH = 60


class Progress(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"rank {tp.rank()} epoch {epoch + 1}", flush=True)


def main():
    out = sys.argv[1]
    with open(os.path.join(out, f"pid_rank{tp.rank()}.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid_rank{tp.rank()}.part"),
               os.path.join(out, f"pid_rank{tp.rank()}"))
    keras.utils.set_random_seed(100 + tp.rank())
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 12)).astype("float32")
    y = (x[:, :5].sum(1) > 0).astype("int32")
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [tp_callbacks.ModelCheckpoint(os.path.join(out, "model.keras")), Progress()]
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)


if __name__ == "__main__":
    sys.exit(main())
