"""Worker for the device-side data path test: the same training with buckets packed on the host
(TF_POSEIDON_DEVICE_PACK=0) and on the device (=1, the CPU kernels here), per configuration.

Run under mpirun. Each configuration (compression, overlap) trains a model with a float32 and
a bfloat16 layer by ``fit`` on 245 rows in global batches of 60 (the last one, 5 rows, split
unevenly), in small buckets, once per setting, each from the same seed. Writes, on every rank,
OUT/datapath_rank<r>.npz with each run's weights as bytes and OUT/datapath_rank<r>.json with
the wire dtype of every pack op traced in each run.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import ops  # noqa: E402
from tf_poseidon.comm import datapath  # noqa: E402

CONFIGS = {"none": ("none", True), "bf16": ("bf16", True), "fp16": ("fp16", True),
           "none-no-overlap": ("none", False)}
ROWS, GLOBAL_BATCH = 245, 60

traced_packs: list[str] = []
_pack = ops.pack


def counting_pack(tensors, wire_dtype, scale=1.0):
    """ops.pack, noting the wire dtype of every pack op the traced steps hold."""
    traced_packs.append(tf.as_dtype(wire_dtype).name)
    return _pack(tensors, wire_dtype, scale)


def train(compression: str, overlap: bool) -> np.ndarray:
    keras.utils.set_random_seed(7 + tp.rank())  # rank 0's initial values reach the others
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(ROWS, 12)).astype("float32")
    y = (x[:, :5].sum(1) > 0).astype("int32") + (x[:, 5:9].sum(1) > 1).astype("int32")
    strategy = tp.PoseidonStrategy(compression=compression, overlap=overlap, sfb="never",
                                   bucket_bytes=256)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(8, activation="relu", dtype="bfloat16"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return np.concatenate([np.frombuffer(v.numpy().tobytes(), np.uint8) for v in model.weights])


def main():
    out = sys.argv[1]
    ops.pack = counting_pack
    weights, packs = {}, {}
    for name, (compression, overlap) in CONFIGS.items():
        for setting in ("0", "1"):
            os.environ[datapath.DEVICE_PACK_ENV] = setting  # read when the step is traced
            del traced_packs[:]
            weights[f"{name}/{setting}"] = train(compression, overlap)
            packs[f"{name}/{setting}"] = list(traced_packs)
    np.savez(os.path.join(out, f"datapath_rank{tp.rank()}.npz"), **weights)
    with open(os.path.join(out, f"datapath_rank{tp.rank()}.json"), "w") as f:
        json.dump(packs, f)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
