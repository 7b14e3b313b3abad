"""Loads an export the way a server would, without importing tf_poseidon.

    export_load.py VERSION_DIR INPUTS.npz OUT.npz

Runs the ``serving_default`` signature of ``tf.saved_model.load(VERSION_DIR)`` on the arrays
of INPUTS.npz (by input name) and writes its outputs (by output name) to OUT.npz.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    version_dir, inputs_path, out = sys.argv[1:4]
    serve = tf.saved_model.load(version_dir).signatures["serving_default"]
    inputs = dict(np.load(inputs_path))
    outputs = serve(**{name: tf.constant(value) for name, value in inputs.items()})
    np.savez(out, **{name: value.numpy() for name, value in outputs.items()})
    assert "tf_poseidon" not in sys.modules


if __name__ == "__main__":
    sys.exit(main())
