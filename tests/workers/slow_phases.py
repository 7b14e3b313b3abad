"""Worker for the timeouts-by-phase tests: long waits of healthy ranks, and a stuck rank 0.

    slow_phases.py healthy DELAY   async EASGD; rank 1 reaches the first meeting DELAY s late and
                                   spends DELAY s more on one batch (rank 0 waits for it at the
                                   end of fit, a meeting point); then rank 0 works alone for
                                   DELAY s (export.run_on_chief) while rank 1 waits
    slow_phases.py chief-long      rank 0 works alone for 600 s, sending heartbeats
    slow_phases.py chief-stopped   rank 0 stops its own process (SIGSTOP) in its work (and
                                   would then work for 600 s)
    slow_phases.py exit-working DELAY
                                   after a short fit, rank 0 works alone for DELAY s before
                                   the end of its program, where rank 1 waits for it
    slow_phases.py exit-stopped    ... rank 0 stops its own process (SIGSTOP) instead
    slow_phases.py exit-stuck      ... rank 0 sleeps 600 s instead (alive, but not coming)
    slow_phases.py chief-fails     rank 0's work raises ValueError; every rank catches what
                                   export.run_on_chief raised and prints "rank <r> raised
                                   <type>: <message>"

The test sets TF_POSEIDON_TIMEOUT below DELAY. Prints "rank <r> fit <s> s", "rank <r>
run_on_chief <s> s" (the chief's work as every rank saw it) and "rank <r> done".
"""

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import export  # noqa: E402


class SlowBatchOnRankOne(keras.callbacks.Callback):
    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def on_train_batch_begin(self, batch, logs=None):
        if tp.rank() == 1 and batch == 5:
            time.sleep(self.delay)


def model_under(strategy) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def chief_work(seconds: float, stop: bool):
    def work() -> int:
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(seconds)
        return 7
    return work


def short_fit(model) -> None:
    x = np.random.default_rng(0).normal(size=(256, 10)).astype("float32")
    model.fit(x, (x[:, 0] > 0).astype("int32"), batch_size=64, epochs=1, verbose=0)


def main(behaviour: str, delay: float) -> None:
    if behaviour.startswith("exit-"):
        short_fit(model_under(tp.PoseidonStrategy()))
        print(f"rank {tp.rank()} done", flush=True)
        if tp.rank() == 0:
            if behaviour == "exit-stopped":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(delay if behaviour == "exit-working" else 600)
        return
    if behaviour == "chief-fails":
        def fail() -> int:
            raise ValueError("the disk is full")
        try:
            export.run_on_chief(model_under(tp.PoseidonStrategy()), fail, "do slow work")
        except (ValueError, RuntimeError) as e:
            print(f"rank {tp.rank()} raised {type(e).__name__}: {e}", flush=True)
        return
    if behaviour == "healthy":
        if tp.rank() == 1:
            time.sleep(delay)
        model = model_under(tp.PoseidonStrategy(mode="easgd", easgd_async=True, tau=2,
                                                alpha=0.45))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(640, 10)).astype("float32")
        y = (x[:, 0] > 0).astype("int32")
        start = time.monotonic()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0,
                  callbacks=[SlowBatchOnRankOne(delay)])
        print(f"rank {tp.rank()} fit {time.monotonic() - start:.1f} s", flush=True)
    else:
        model = model_under(tp.PoseidonStrategy())
    start = time.monotonic()
    seconds = delay if behaviour == "healthy" else 600
    result = export.run_on_chief(model, chief_work(seconds, behaviour == "chief-stopped"),
                                 "do slow work")
    assert result == 7, result
    print(f"rank {tp.rank()} run_on_chief {time.monotonic() - start:.1f} s", flush=True)
    print(f"rank {tp.rank()} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
