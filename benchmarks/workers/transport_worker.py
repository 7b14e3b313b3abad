"""Times the engine's float32 all-reduce against the fp16/bf16 compressed one (see
benchmarks/bench_transport.py). Prints, on rank 0, one JSON line of median seconds."""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon.comm import codecs  # noqa: E402
from tf_poseidon.comm.engine import get_engine  # noqa: E402


def main(megabytes: float, repeats: int) -> None:
    engine = get_engine()
    payload = np.random.default_rng(tp.rank()).normal(
        size=int(megabytes * 2**20 / 4)).astype(np.float32)
    results = {}
    for name, codec in (("fp32", "none"), ("fp16", "fp16"), ("bf16", "bf16")):
        collective = codecs.get(codec)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            data = payload.copy()
            engine.call(lambda comm: comm.Barrier())
            start = time.perf_counter()
            engine.call(lambda comm: collective.sum_into(comm, data, data))
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[1:])
    if tp.is_chief():
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
