"""Worker for tests/test_lowrank.py: PowerSGD low-rank compression in real multi-rank jobs.

    lowrank_train.py OUT RUN[,RUN...]

Each run builds its own strategy and model; every rank seeds with its own rank, so rank 0's
initial values (or a restored backup) must reach the others. Per run, every rank writes
OUT/<run>_rank<r>.json or .npz:

* ``exact`` — a small CNN trained by SGD with every matrix low-rank at full rank (rank >=
  min(m, n), start_step=0) and with all-reduce, 233 rows at global batch 64 (uneven batch
  shares, a short last batch): the weights as this rank built them ("initial"), after the
  first step and at the end of both (npz), and the digest of the low-rank run's weights after
  every step.
* ``digits-<cnn|mlp>-<sync|lowrank>`` — examples/train_digits.py's model and data, Adam,
  EPOCHS epochs; lowrank: tp.PowerSGD(rank=4, choice="always"). Test accuracy, the plan, the
  bytes of the last step per layer, the low-rank compute seconds, the weights' digest after
  every step.
* ``plan`` — sfb="auto" and PowerSGD(choice="auto") at bandwidth_gbps=0.05 on a model with
  a convolution and Dense layers of several sizes: strategy.plan().as_dict() and its table.
* ``resume`` — the digits MLP with PowerSGD(rank=2, start_step=5, choice="always") for two
  epochs with a BackupAndRestore every 10 steps: uninterrupted; stopped after 30 steps; a
  fresh strategy and model resuming from that backup; the same resuming from a copy of the
  backup whose low-rank state was removed. Final weights of the four (npz) and the backup's
  state entries.
* ``feedback`` — the low-rank protocol alone on synthetic gradients for STEPS steps through
  the engine (rank 2 of 24x24 and 40x16 matrices, uneven counts every 7th step), with error
  feedback and with the residuals cleared before every step: per step, the gap between the
  running sums of exact and applied gradients, the norm of the exact sum, the digest of the
  result; at the end the summed residuals' difference from the gap (conservation).
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                os.pardir, "examples"))
import train_digits  # noqa: E402

EPOCHS = 20
STEPS = 150


class Digests(keras.callbacks.Callback):
    """The sha256 of the model's weights after every training step."""

    def __init__(self):
        super().__init__()
        self.digests = []

    def on_train_batch_end(self, batch, logs=None):
        flat = np.concatenate([np.ravel(w) for w in self.model.get_weights()])
        self.digests.append(hashlib.sha256(flat.tobytes()).hexdigest())


def weights(model) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


def write_json(out, name, report):
    with open(os.path.join(out, f"{name}_rank{tp.rank()}.json"), "w") as f:
        json.dump(report, f)


# -- exactness at full rank --------------------------------------------------------------------

def exact(out):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(233, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 5, size=233).astype("int32")
    arrays, digests = {}, None
    for name, lowrank in (("allreduce", None),
                          ("lowrank", tp.PowerSGD(rank=256, start_step=0, min_compression=1e-3,
                                                  choice="always"))):
        strategy = tp.PoseidonStrategy(sfb="never", lowrank=lowrank)
        keras.utils.set_random_seed(100 + tp.rank())
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(5)])
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        digest = Digests()
        arrays["initial"] = weights(model)  # rank 0's are every rank's after the broadcast
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, shuffle=False, verbose=0)
        arrays[f"{name}_first"] = weights(model)
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  callbacks=[digest])
        arrays[f"{name}_end"] = weights(model)
        if lowrank is not None:
            digests = digest.digests
            plan = strategy.plan().as_dict()
    np.savez(os.path.join(out, f"exact_rank{tp.rank()}.npz"), **arrays)
    write_json(out, "exact", {"digests": digests, "plan": plan})


# -- convergence on digits ---------------------------------------------------------------------

def digits(out, run):
    _, kind, algorithm = run.split("-")
    keras.utils.set_random_seed(0)
    x_train, y_train, x_test, y_test = train_digits.load_data(0)
    lowrank = tp.PowerSGD(rank=4, choice="always") if algorithm == "lowrank" else None
    strategy = tp.PoseidonStrategy(lowrank=lowrank)
    with strategy.scope():
        model = train_digits.build_model(kind)
        model.compile(optimizer=keras.optimizers.Adam(3e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    digest = Digests()
    model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[digest])
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    stats = strategy.stats(last_steps=1)
    write_json(out, run, {"accuracy": float(accuracy), "digests": digest.digests,
                          "plan": strategy.plan().as_dict(),
                          "per_layer": stats["per_layer"], "mode": stats["mode"]})


# -- the plan ----------------------------------------------------------------------------------

def plan(out):
    strategy = tp.PoseidonStrategy(lowrank=tp.PowerSGD(), bandwidth_gbps=0.05)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu", name="wide"),
            keras.layers.Dense(256, activation="relu", name="square"),
            keras.layers.Dense(10, name="logits")])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(128, 8, 8, 3)).astype("float32"),
              rng.integers(0, 10, size=128).astype("int32"), batch_size=64, verbose=0)
    result = strategy.plan()
    write_json(out, "plan", {"plan": result.as_dict(), "table": result.table()})


# -- resuming from a backup --------------------------------------------------------------------

class StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            self.model.stop_training = True


def resume(out):
    x_train, y_train, _, _ = train_digits.load_data(0)

    def train(backup_dir, seed, extra=(), delete=True):
        strategy = tp.PoseidonStrategy(
            lowrank=tp.PowerSGD(rank=2, start_step=5, choice="always"))
        keras.utils.set_random_seed(seed + tp.rank())
        with strategy.scope():
            # Named layers: the same variable paths in every run (a resumed job's new process
            # has them too), which key the low-rank state.
            model = keras.Sequential([
                keras.Input((8, 8, 1)), keras.layers.Flatten(name="flat"),
                keras.layers.Dense(128, activation="relu", name="h1"),
                keras.layers.Dense(64, activation="relu", name="h2"),
                keras.layers.Dense(10, name="out")], name="mlp")
            model.compile(optimizer=keras.optimizers.Adam(3e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backup = tp_callbacks.BackupAndRestore(backup_dir, save_freq=10,
                                               delete_checkpoint=delete)
        model.fit(x_train, y_train, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  callbacks=[backup, *extra])
        return weights(model)

    base = os.path.join(out, "resume")
    results = {"uninterrupted": train(f"{base}-a", 10)}
    train(f"{base}-b", 10, [StopAfter(30)], delete=False)
    with open(os.path.join(f"{base}-b", "training_metadata.json")) as f:
        metadata = json.load(f)
    with np.load(os.path.join(f"{base}-b", metadata["state"])) as state:
        entries = {name: list(state[name].shape) for name in state}
    # Every rank resumes from its own copy of rank 0's backup (only rank 0 writes to it).
    copy, stripped = f"{base}-c{tp.rank()}", f"{base}-d{tp.rank()}"
    shutil.copytree(f"{base}-b", copy)
    shutil.copytree(f"{base}-b", stripped)
    state_file = os.path.join(stripped, metadata["state"])
    with np.load(state_file) as state:
        kept = {name: state[name] for name in state if not name.startswith("algorithm/")}
    with open(state_file, "wb") as f:
        np.savez(f, **kept)
    results["resumed"] = train(copy, 50)
    results["resumed_without_lowrank_state"] = train(stripped, 50)
    np.savez(os.path.join(out, f"resume_rank{tp.rank()}.npz"), **results)
    write_json(out, "resume", {"metadata": metadata, "state_entries": entries})


# -- error feedback on its own -----------------------------------------------------------------

def feedback(out):
    from tf_poseidon.comm import codecs
    from tf_poseidon.comm.buckets import Bucket
    from tf_poseidon.comm.engine import get_engine
    from tf_poseidon.comm.protocol import BucketCall
    from tf_poseidon.lowrank import protocol as lowrank_protocol

    size, rank, engine = tp.size(), tp.rank(), get_engine()
    shapes = [(24, 24), (40, 16)]
    items = tuple(lowrank_protocol.item(f"m{i}", s) for i, s in enumerate(shapes))
    bucket = Bucket(0, lowrank_protocol.KIND, (0, 1), items, np.dtype(np.float32))
    base = [np.random.default_rng(99).normal(size=s) for s in shapes]

    def gradients(step, p):
        """Rank p's per-example mean gradients at ``step`` (a common direction plus noise)."""
        rng = np.random.default_rng([step, p])
        return [(b + 2 * rng.normal(size=b.shape)).astype(np.float32) for b in base]

    def counts(step):
        return [10] * size if step % 7 else [3 + p % 2 if p else 0 for p in range(size)]

    report = {}
    for mode in ("feedback", "cleared"):
        proto = lowrank_protocol.LowRankProtocol(tp.PowerSGD(rank=2, start_step=0),
                                                 codecs.get("none"))
        applied = [np.zeros(s) for s in shapes]
        exact_sum = [np.zeros(s) for s in shapes]
        gaps, norms, digests = [], [], []
        for step in range(STEPS):
            if mode == "cleared":
                kept = engine.call(proto.state_arrays)
                proto.restore({k: v for k, v in kept.items() if not k.endswith("/residual")},
                              size)
            c = counts(step)
            weight = size / sum(c)
            mine = gradients(step, rank)
            arrays = [a for g in mine for a in (g * c[rank], np.array([c[rank]], np.float32))]
            payload = proto.pack(bucket, arrays)
            result = engine.call(lambda comm: proto.run(
                comm, BucketCall("feedback", 0, step, bucket, payload)).value.copy())
            digests.append(hashlib.sha256(result.tobytes()).hexdigest())
            at, exact_step = 0, []
            for i, s in enumerate(shapes):
                n = s[0] * s[1]
                applied[i] += weight * result[at:at + n].reshape(s)
                total = sum(c[p] * gradients(step, p)[i] for p in range(size)) * weight
                exact_sum[i] += total
                exact_step.append(total)
                at += n
            gaps.append(float(np.sqrt(sum(((e - a) ** 2).sum()
                                          for e, a in zip(exact_sum, applied)))))
            norms.append(float(np.sqrt(sum((e ** 2).sum() for e in exact_step))))
        state = engine.call(proto.state_arrays)
        conservation = None
        if rank == 0 and mode == "feedback":
            # The residuals are kept in the payload's units at the last step's weight w.
            conservation = max(float(np.abs(
                e - a - state[f"m{i}/weight"] * state[f"m{i}/residual"]).max())
                for i, (e, a) in enumerate(zip(exact_sum, applied)))
        report[mode] = {"gaps": gaps, "norms": norms, "digests": digests,
                        "conservation": conservation,
                        "scale": max(float(np.abs(e).max()) for e in exact_sum)}
    write_json(out, "feedback", report)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs")
    args = parser.parse_args()
    for run in args.runs.split(","):
        if run == "exact":
            exact(args.out)
        elif run.startswith("digits-"):
            digits(args.out, run)
        elif run == "plan":
            plan(args.out)
        elif run == "resume":
            resume(args.out)
        elif run == "feedback":
            feedback(args.out)
        else:
            raise SystemExit(f"unknown run {run!r}")


if __name__ == "__main__":
    main()
