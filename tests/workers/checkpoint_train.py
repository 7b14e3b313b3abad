"""Worker for tests/test_checkpoints.py: trains with tp.callbacks, optionally dies mid-run.

    checkpoint_train.py OUT [--reference] [--backup DIR [--interrupt-after K]
                            [--save-freq N] [--dropout] [--kill-rank1-at E:B]]
                            [--plain [--kill-rank1-at E:B]] [--lost-marker FILE]

Every rank works in OUT/rank<r>/ (its own working directory, so a file a non-chief rank wrote
through a relative path would show up there) and seeds with its own rank (rank 0's initial
values, or the restored backup, must reach the others); every model starts from that seed, and
fit shuffles (Keras' default) with the permutation rank 0's seed gives, the same in every epoch
and every run, so a resumed run sees the interrupted run's order.

* ``--reference``: first a fit with Keras' own ModelCheckpoint (refused: its message, or ""
  if it trained, in OUT/refused_rank<r>.txt); then trains EPOCHS epochs uninterrupted with two
  ModelCheckpoints (relative paths ``ckpt/epoch<e>.weights.h5`` and ``best.keras``), a
  BackupAndRestore (``backup``, deleted at the end) and Keras' CSVLogger (``log.csv``);
  writes OUT/reference_rank<r>.npz; then Keras' ``model.save("final.keras")`` and
  ``model.save_weights("final.weights.h5")`` and ``model.export("final_saved_model")``.
* ``--backup DIR``: then trains a fresh model with BackupAndRestore(DIR) (resuming from it if
  it holds a backup); with ``--interrupt-after K`` every rank SIGKILLs itself at the end of
  epoch K, after the backup of that epoch returned. Writes OUT/resumed_rank<r>.npz.
* ``--save-freq N``: the BackupAndRestore backs up every N batches instead of every epoch.
* ``--dropout``: the model has a Dropout layer (its random generator's state matters).
* ``--plain``: trains a fresh model with no BackupAndRestore (a restart starts from scratch);
  writes OUT/plain_rank<r>.npz.
* ``--kill-rank1-at E:B``: rank 1 SIGKILLs itself before batch B of epoch E (1-based), on the
  first launch only (``TF_POSEIDON_RESTART`` unset or 0; tfposeidon-run --max-restarts sets it).
* ``--lost-marker FILE``: rank 1 creates FILE just before it kills itself (a test's rsh agent
  then refuses rank 1's host: the host is lost with its rank).
"""

import argparse
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402

GLOBAL_BATCH = 60
ROWS = 700  # 11 full global batches and one of 40 rows: uneven shares at P=3
EPOCHS = 4


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 12)).astype("float32")
    y = (x[:, :5].sum(1) > 0).astype("int32") + (x[:, 5:9].sum(1) > 1).astype("int32")
    return x, y


def new_model(strategy, dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(100 + tp.rank())  # the same start for every run of the job
    with strategy.scope():
        middle = [keras.layers.Dropout(0.3)] if dropout else []
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                                  *middle, keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class KillAfter(keras.callbacks.Callback):
    """SIGKILLs this process at the end of epoch ``k`` (1-based), like a preempted host."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.k:
            os.kill(os.getpid(), signal.SIGKILL)


class KillRank1At(keras.callbacks.Callback):
    """SIGKILLs rank 1 before batch ``b`` of epoch ``e`` (1-based), on a job's first launch,
    after creating ``marker`` if given."""

    def __init__(self, spec: str, marker: str | None = None):
        super().__init__()
        self.epoch, self.batch = (int(n) for n in spec.split(":"))
        self.marker = marker
        self.current = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch + 1

    def on_train_batch_begin(self, batch, logs=None):
        first_launch = os.environ.get("TF_POSEIDON_RESTART", "0") == "0"
        if first_launch and tp.rank() == 1 and (self.current, batch + 1) == (self.epoch,
                                                                             self.batch):
            if self.marker:
                open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def train(model, callbacks, out):
    x, y = data()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, callbacks=callbacks,
                        verbose=0)
    np.savez(out, loss=np.array(history.history["loss"]),
             weights=np.concatenate([v.numpy().ravel() for v in model.weights]),
             optimizer=np.concatenate([np.ravel(v.numpy()) for v in model.optimizer.variables]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--backup")
    parser.add_argument("--interrupt-after", type=int)
    parser.add_argument("--save-freq", type=int)
    parser.add_argument("--dropout", action="store_true")
    parser.add_argument("--kill-rank1-at")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--lost-marker")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    workdir = os.path.join(out, f"rank{tp.rank()}")
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    strategy = tp.PoseidonStrategy()
    if args.reference:
        try:
            new_model(strategy).fit(*data(), callbacks=[keras.callbacks.ModelCheckpoint(
                "keras.weights.h5", save_weights_only=True)], verbose=0)
            refused = ""
        except ValueError as e:
            refused = str(e)
        with open(os.path.join(out, f"refused_rank{tp.rank()}.txt"), "w") as f:
            f.write(refused)
        callbacks = [
            tp_callbacks.ModelCheckpoint("ckpt/epoch{epoch}.weights.h5", save_weights_only=True),
            tp_callbacks.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True),
            tp_callbacks.BackupAndRestore("backup"),
            keras.callbacks.CSVLogger("log.csv"),
        ]
        model = new_model(strategy)
        train(model, callbacks, os.path.join(out, f"reference_rank{tp.rank()}"))
        model.save("final.keras")  # every rank, as a Keras script ends
        model.save_weights("final.weights.h5")
        model.export("final_saved_model", verbose=False)
    if args.backup:
        callbacks = [tp_callbacks.BackupAndRestore(args.backup,
                                                   save_freq=args.save_freq or "epoch")]
        if args.interrupt_after:
            callbacks.append(KillAfter(args.interrupt_after))
        if args.kill_rank1_at:
            callbacks.append(KillRank1At(args.kill_rank1_at, args.lost_marker))
        train(new_model(strategy, args.dropout), callbacks,
              os.path.join(out, f"resumed_rank{tp.rank()}"))
    if args.plain:
        callbacks = [KillRank1At(args.kill_rank1_at)] if args.kill_rank1_at else []
        train(new_model(strategy), callbacks, os.path.join(out, f"plain_rank{tp.rank()}"))
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
