"""The CUDA kernels on this machine's GPU (tier ``gpu``): ci/check_cuda_on_gpu.sh builds the
standalone harness kernels/cuda_harness.cu for the local GPU and runs every kernel launcher
against a CPU reference. Skipped, with the reason, where no GPU is visible (tests/conftest.py)
or no nvcc is installed."""

import os
import subprocess

import pytest

from test_cuda_build import NVCC, REPO

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH, in $NVCC or /usr/local/cuda/bin: "
                                         "the CUDA kernels cannot be built here")
def test_cuda_kernels_match_the_cpu_reference_on_the_gpu(tmp_path):
    done = subprocess.run(["bash", str(REPO / "ci" / "check_cuda_on_gpu.sh"), str(tmp_path)],
                          cwd=REPO, env=dict(os.environ, NVCC=NVCC), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    checks = [line for line in done.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))]
    assert checks and all(line.startswith("PASS ") for line in checks), checks
    assert "OK: 0 failure(s)" in done.stdout
