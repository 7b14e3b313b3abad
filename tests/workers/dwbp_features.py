"""Worker for the wait-free backprop tests: Keras fits with the options given, then dumps.

    dwbp_features.py OUT [--no-overlap] [--bucket-bytes N] [--timeline FILE]
                         [--features FEATURE[,FEATURE...]]

One fit per feature, in this process, each with a new strategy and model: ``plain``, or one of
the Keras features that touch the gradient path: ``steps_per_execution`` (4),
``clipnorm`` (0.05), ``global_clipnorm`` (0.1), ``no_gradient_variable`` (one layer is built
but not on the loss path, so its variables get no gradient). Writes
OUT/<feature>_rank<r>.npz (weights, loss history) and OUT/<feature>_stats_rank<r>.json
(strategy.stats()). The model has wide layers (several buckets).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402


FEATURES = {"plain": {}, "steps_per_execution": {"steps_per_execution": 4},
            "clipnorm": {"clipnorm": 0.05}, "global_clipnorm": {"global_clipnorm": 0.1},
            "no_gradient_variable": {"frozen": True}}


def fit(args, feature: str) -> None:
    options = FEATURES[feature]
    keras.utils.set_random_seed(7 + tp.rank())
    rng = np.random.default_rng(3)
    x = rng.normal(size=(22 * 48, 32)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    strategy = tp.PoseidonStrategy(overlap=not args.no_overlap, bucket_bytes=args.bucket_bytes,
                                   timeline=args.timeline and os.path.join(args.out, args.timeline))
    with strategy.scope():
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(256, activation="relu", name="wide1")(inputs)
        # A layer outside the loss path: its variables get no gradient.
        unused = keras.layers.Dense(8, name="unused")
        if options.get("frozen"):
            unused(inputs)  # built, part of the model's weights, but not of the loss
        hidden = keras.layers.Dense(256, activation="relu", name="wide2")(hidden)
        outputs = keras.layers.Dense(10, name="logits")(hidden)
        model = keras.Model(inputs, outputs)
        if options.get("frozen"):
            model.unused = unused
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9,
                                                     clipnorm=options.get("clipnorm"),
                                                     global_clipnorm=options.get("global_clipnorm")),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=options.get("steps_per_execution", 1))
    history = model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0)
    weights = np.concatenate([v.numpy().ravel() for v in model.weights])
    np.savez(os.path.join(args.out, f"{feature}_rank{tp.rank()}.npz"), weights=weights,
             loss=history.history["loss"])
    with open(os.path.join(args.out, f"{feature}_stats_rank{tp.rank()}.json"), "w") as f:
        json.dump(strategy.stats(last_steps=50), f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--bucket-bytes", type=int)
    parser.add_argument("--timeline", help="file name, relative to OUT")
    parser.add_argument("--features", default="plain", help="comma-separated, of FEATURES")
    args = parser.parse_args()
    for feature in args.features.split(","):
        fit(args, feature)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    main()
