"""Worker for tests/test_export.py: trains a two-input, two-output model and exports it.

    export_model.py OUT

Every rank works in OUT/rank<r>/ and exports to the relative path ``export`` (so an export
written by a rank other than 0 would show up in its own directory), seeded with its own rank.
Exports three versions (None, None, 10), then provokes two errors rank 0 detects (an existing
version; an export_dir that is a file). Writes OUT/result_rank<r>.json (the returned paths, the
error types each rank saw) and, on rank 0, OUT/inputs.npz and OUT/predictions.npz
(``model.predict`` of those inputs, by output name).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon.export import export_for_serving  # noqa: E402


def new_model() -> keras.Model:
    features = keras.Input((12,), name="features")
    context = keras.Input((3,), name="context")
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([features, context]))
    outputs = {"logits": keras.layers.Dense(3)(hidden),
               "score": keras.layers.Dense(1, activation="sigmoid")(hidden)}
    return keras.Model({"features": features, "context": context}, outputs)


def error_of(call) -> str | None:
    try:
        call()
    except Exception as e:  # the test compares the types every rank saw
        return type(e).__name__
    return None


def main():
    out = os.path.abspath(sys.argv[1])
    workdir = os.path.join(out, f"rank{tp.rank()}")
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    keras.utils.set_random_seed(100 + tp.rank())
    rng = np.random.default_rng(3)
    inputs = {"features": rng.normal(size=(240, 12)).astype("float32"),
              "context": rng.normal(size=(240, 3)).astype("float32")}
    targets = {"logits": rng.integers(0, 3, size=240).astype("int32"),
               "score": rng.uniform(size=(240, 1)).astype("float32")}
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = new_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss={"logits": keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), "score": "mse"})
    model.fit(inputs, targets, batch_size=60, epochs=2, shuffle=False, verbose=0)
    paths = [export_for_serving(model, "export"), export_for_serving(model, "export"),
             export_for_serving(model, "export", version=10)]
    if tp.is_chief():
        open("a_file", "w").close()
    errors = [error_of(lambda: export_for_serving(model, "export", version=10)),
              error_of(lambda: export_for_serving(model, "a_file"))]
    with open(os.path.join(out, f"result_rank{tp.rank()}.json"), "w") as f:
        json.dump({"paths": paths, "errors": errors}, f)
    predictions = model.predict(inputs, batch_size=60, verbose=0)
    if tp.is_chief():
        np.savez(os.path.join(out, "inputs.npz"), **inputs)
        np.savez(os.path.join(out, "predictions.npz"), **predictions)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
