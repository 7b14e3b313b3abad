"""Worker for the EASGD convergence test: examples/train_digits.py in sync mode and in both
EASGD forms, one after the other in one job, with the same seed. Prints on rank 0 one line
``ACCURACY {"sync": ..., "easgd": ..., "easgd_async": ...}`` (global test accuracies).

    tfposeidon-run -np 2 python tests/workers/easgd_digits.py --tau 4 --alpha 0.45 \
        --async-alpha 0.45 [--epochs 10] [--runs sync,easgd,easgd_async]
    python tests/workers/easgd_digits.py --runs sync                  # one process
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))

import train_digits  # noqa: E402

import tf_poseidon as tp  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tau", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.45, help="synchronous form")
    parser.add_argument("--async-alpha", type=float, default=0.45)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs", default="sync,easgd,easgd_async")
    args = parser.parse_args()
    runs = {
        "sync": ["--mode", "sync"],
        "easgd": ["--mode", "easgd", "--tau", str(args.tau), "--alpha", str(args.alpha)],
        "easgd_async": ["--mode", "easgd", "--easgd-async", "--tau", str(args.tau),
                        "--alpha", str(args.async_alpha)],
    }
    accuracy = {}
    for name in args.runs.split(","):
        example_args = train_digits.parse_args(runs[name] + ["--epochs", str(args.epochs),
                                                             "--verbose", "0"])
        accuracy[name] = float(train_digits.train(example_args))
    if tp.is_chief():
        print("ACCURACY " + json.dumps(accuracy), flush=True)


if __name__ == "__main__":
    main()
