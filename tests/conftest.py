"""Suite-wide settings: the compiled op is required, TensorFlow's start-up chatter is quiet,
and the repository's benchmarks/ package is importable (appended to sys.path, so that
``tf_poseidon`` still comes from the installed package, with its compiled op)."""

import os
import sys

os.environ.setdefault("TF_POSEIDON_REQUIRE_OPS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
