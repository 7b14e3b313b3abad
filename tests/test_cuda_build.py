"""The CUDA side of the kernels compiles with this machine's nvcc (issue: kernels must build for
GPUs even where none is present to run them). Runs ci/build_cuda_objects.sh, which compiles
every kernels/*.cu with TensorFlow's flags and the GPU registration with GOOGLE_CUDA=1.

Skipped, with the reason, only where no nvcc is installed: then nothing CUDA can be checked."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NVCC = os.environ.get("NVCC") or shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH, in $NVCC or /usr/local/cuda/bin: "
                                         "the CUDA kernels cannot be compiled here")
def test_cuda_kernels_compile_to_objects(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, NVCC=NVCC)
    done = subprocess.run(["bash", str(REPO / "ci" / "build_cuda_objects.sh"), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    objects = sorted(p.name for p in tmp_path.glob("*.o"))
    sources = sorted(p.name + ".o" for p in (REPO / "kernels").glob("*.cu"))
    assert objects == sorted(sources + ["poseidon_kernels_gpu.cc.o"]), objects
    assert all((tmp_path / o).stat().st_size > 0 for o in objects)
