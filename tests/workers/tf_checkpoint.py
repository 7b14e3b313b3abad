"""Worker for test_checkpoints.py: a custom training loop that checkpoints with TensorFlow's
``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``, as TensorFlow's guides do, on every
rank.

    tf_checkpoint.py OUT             (under tfposeidon-run)
    tf_checkpoint.py OUT --restore   (one process, after the job)

Trains an MLP of 4.5 M parameters with Adam for 12 steps (custom_loop.py); after every step
``manager.save()`` (``max_to_keep=2``) into OUT/managed, then ``checkpoint.write(OUT/final)``,
``tf.saved_model.save(model, OUT/saved_model)`` and an asynchronous ``checkpoint.save``, which
must be refused. Every rank writes
OUT/rank<r>.json: what each call returned on it, its manager's state, and whether the
asynchronous save raised (its message); and OUT/rank<r>.npz: its final weights and optimizer
variables. With ``--restore``, a process that wrote nothing reads OUT/final and the manager's
latest checkpoint into a model of its own and writes OUT/restored.json: for each, the largest
difference from rank 0's final weights and optimizer variables, and the save counter read; and
the largest difference between the SavedModel's outputs and that model's on 8 rows.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from custom_loop import train_step  # noqa: E402

GLOBAL_BATCH, STEPS = 32, 12


def model_and_optimizer():
    """The model and its built optimizer (call under the strategy's scope, or none)."""
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(1024), keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def main(out: str) -> None:
    keras.utils.set_random_seed(1000 * tp.rank())  # rank 0's initial values reach every rank
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 1024)).astype("float32")
    y = rng.integers(0, 10, size=GLOBAL_BATCH * STEPS).astype("int64")
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model, optimizer = model_and_optimizer()
    step = train_step(strategy, model, optimizer, GLOBAL_BATCH)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(out, "managed"), max_to_keep=2)
    saved = []
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        step(xb, yb)
        saved.append(manager.save())
    written = checkpoint.write(os.path.join(out, "final"))
    tf.saved_model.save(model, os.path.join(out, "saved_model"))
    try:
        checkpoint.save(os.path.join(out, "async"), options=tf.train.CheckpointOptions(
            experimental_enable_async_checkpoint=True))
        refused = None
    except ValueError as e:
        refused = str(e)
    rank = tp.rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"saved": saved, "written": written, "latest": manager.latest_checkpoint,
                   "checkpoints": manager.checkpoints, "save_counter": int(
                       checkpoint.save_counter), "async_refused": refused}, f)
    np.savez(os.path.join(out, f"rank{rank}.npz"),
             *[v.numpy() for v in model.weights + optimizer.variables])
    print(f"rank {rank} done", flush=True)


def restore(out: str) -> None:
    model, optimizer = model_and_optimizer()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.save_counter  # created before reading, as a saved checkpoint holds it
    trained = np.load(os.path.join(out, "rank0.npz"))
    differences = {}
    for name, path in [("final", os.path.join(out, "final")),
                       ("latest", tf.train.latest_checkpoint(os.path.join(out, "managed")))]:
        checkpoint.read(path).assert_consumed()
        differences[name] = max(float(np.max(np.abs(v.numpy() - trained[f"arr_{i}"])))
                                for i, v in enumerate(model.weights + optimizer.variables))
        differences[f"{name} save_counter"] = int(checkpoint.save_counter)
    rows = np.random.default_rng(1).normal(size=(8, 1024)).astype("float32")
    served = tf.saved_model.load(os.path.join(out, "saved_model")).signatures["serving_default"]
    differences["saved_model"] = float(np.max(np.abs(
        next(iter(served(tf.constant(rows)).values())).numpy() - model(rows).numpy())))
    with open(os.path.join(out, "restored.json"), "w") as f:
        json.dump(differences, f)


if __name__ == "__main__":
    (restore if sys.argv[2:] == ["--restore"] else main)(sys.argv[1])
