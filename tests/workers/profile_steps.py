"""Profiles 3 steps of a small MLP's fit with tp.profiling.StepProfiler and prints each rank's
StepProfile as one JSON line ``PROFILE {...}``. Argument: the PoseidonStrategy options as JSON.
"""

import json
import sys

import numpy as np

import tf_poseidon as tp

import keras  # noqa: E402  (after tf_poseidon, which places the process)

from tf_poseidon.profiling import StepProfiler  # noqa: E402

strategy = tp.PoseidonStrategy(**json.loads(sys.argv[1]))
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x, y = rng.random((64 * 8, 256), np.float32), rng.integers(0, 10, 64 * 8)
profiler = StepProfiler(first_step=2, steps=3, verbose=False)
model.fit(x, y, batch_size=64, epochs=1, callbacks=[profiler], verbose=0)
print("PROFILE", json.dumps({"rank": tp.rank(), **profiler.profile.as_dict()}), flush=True)
