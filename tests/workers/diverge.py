"""Worker for test_collective_agreement.py: ranks that post different collectives.

    diverge.py chief_evaluate   after fit, only rank 0 runs evaluate (`if tp.is_chief():`)
    diverge.py callback         a callback reduces on rank 0 only, at the end of epoch 1
    diverge.py terminate_on_nan SSP (staleness 2): a NaN in rank 0's rows of batch 3 makes
                                TerminateOnNaN stop training on rank 0 only
    diverge.py lengths_steps    rank 0 gets 100 rows, rank 1 130 (batch 32: 4 vs 5 steps)
    diverge.py lengths_rows     rank 0 gets 100 rows, rank 1 110 (4 steps each, last 4 vs 14)

Prints ``DIVERGE <unix time>`` just before the ranks go different ways.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402


def diverging() -> None:
    print(f"DIVERGE {time.time()}", flush=True)


def main(scenario: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8)).astype("float32")
    y = rng.normal(size=(160, 1)).astype("float32")
    options = {"mode": "ssp", "staleness": 2} if scenario == "terminate_on_nan" else {}
    strategy = tp.PoseidonStrategy(**options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    if scenario == "chief_evaluate":
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        diverging()
        if tp.is_chief():
            model.evaluate(x, y, batch_size=32, verbose=0)
    elif scenario == "callback":
        class ReduceOnRankZero(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                diverging()
                if tp.rank() == 0:
                    strategy.reduce("SUM", tf.constant(1.0), axis=None)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[ReduceOnRankZero()])
    elif scenario == "terminate_on_nan":
        x[3 * 32 + 5] = np.nan  # batch 3, row 5: rank 0's half of it
        diverging()
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.TerminateOnNaN()])
    else:
        mine = 100 if tp.rank() == 0 else {"lengths_steps": 130, "lengths_rows": 110}[scenario]
        diverging()
        model.fit(x[:mine], y[:mine], batch_size=32, epochs=1, verbose=0)
    print(f"rank {tp.rank()} finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
