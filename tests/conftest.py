"""Suite-wide settings: the compiled op is required, TensorFlow's start-up chatter is quiet."""

import os

os.environ.setdefault("TF_POSEIDON_REQUIRE_OPS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
