"""Suite-wide settings: the compiled op is required, TensorFlow's start-up chatter is quiet,
the repository's benchmarks/ package is importable (appended to sys.path, so that
``tf_poseidon`` still comes from the installed package, with its compiled op), and the tiers.

Tiers (markers; README.md, "Development"): unmarked tests run in this process (the fast tier);
``multirank`` tests start training jobs (tests/workers/, examples/): with mpirun, or alone as
the single-process runs they are compared with; ``cluster`` tests build network namespaces
(root, iproute2); ``gpu`` tests need an NVIDIA GPU and are skipped, with the reason, where
nvidia-smi lists none.

This process's TensorFlow gets LOOPBACK_INTER_OP_THREADS inter-op threads: the fast tier's
loopback tests (tf_poseidon/testing/loopback.py) run the P ranks of a job as threads of this
one process, and while a traced step waits for its peers, each rank's collect op holds one
inter-op thread (comm/graph_ops.py). P processes would have a pool each; here the ranks share
one, which by default has as many threads as cores, so that a thread held a moment longer by
an earlier test can leave a rank with none to hand its buckets over.
"""

import functools
import os
import shutil
import subprocess
import sys

import pytest

os.environ.setdefault("TF_POSEIDON_REQUIRE_OPS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOPBACK_INTER_OP_THREADS = 8

import tensorflow as tf  # noqa: E402  (after the log level is set)

tf.config.threading.set_inter_op_parallelism_threads(LOOPBACK_INTER_OP_THREADS)

TIERS = {
    "multirank": "starts training jobs of tests/workers/ or examples/ (mpirun, or alone)",
    "cluster": "builds an emulated cluster of network namespaces (needs root and iproute2)",
    "gpu": "needs an NVIDIA GPU (skipped where nvidia-smi lists none)",
}


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


PLOTTING = os.path.join(sys.prefix, "plotting")
"""Where ci/test.sh installs matplotlib: not in site-packages, because Keras imports matplotlib
(and scikit-learn) at start-up wherever it can, and every rank of every test job would pay
for it (README.md, "Development")."""


@pytest.fixture
def plotting_path(monkeypatch) -> str:
    """A directory to add to PYTHONPATH for a process that draws charts ("" where matplotlib is
    importable anyway); appended to this process's sys.path too. Fails where there is none."""
    import importlib.util
    if not os.path.isdir(os.path.join(PLOTTING, "matplotlib")):
        if importlib.util.find_spec("matplotlib") is not None:
            return ""
        pytest.fail(f"matplotlib is needed: ci/test.sh installs it into {PLOTTING}, or "
                    "pip install matplotlib")
    # After site-packages: the numpy that pip put beside matplotlib must not shadow the venv's.
    monkeypatch.setattr(sys, "path", [*sys.path, PLOTTING])
    return PLOTTING


@functools.cache
def gpus_missing() -> str | None:
    """Why no GPU test can run here, or None when nvidia-smi lists a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "needs an NVIDIA GPU: no nvidia-smi on PATH"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"needs an NVIDIA GPU: nvidia-smi -L failed ({e})"
    return None if "GPU " in listed else "needs an NVIDIA GPU: nvidia-smi -L lists none"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and gpus_missing():
            item.add_marker(pytest.mark.skip(reason=gpus_missing()))
