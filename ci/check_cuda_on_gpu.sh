#!/usr/bin/env bash
# For a machine with an NVIDIA GPU and the CUDA toolkit (no TensorFlow needed): builds the
# standalone harness kernels/cuda_harness.cu with the CUDA kernels for the local GPU and runs it:
# every launcher against a CPU reference (PASS/FAIL lines), then timings (TIME lines).
# Exit status: the harness's (0 iff every check passed), or the compiler's.
#
#   ci/check_cuda_on_gpu.sh [OUT_DIR]       # default build/cuda_harness
# Environment: NVCC (default nvcc), CUDA_ARCH (default native: the GPU of this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
OUT=${1:-build/cuda_harness}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$NVCC" --version | tail -1
"$NVCC" -std=c++17 -O3 -arch="${CUDA_ARCH:-native}" -Ikernels \
    kernels/cuda_harness.cu kernels/poseidon_cuda.cu -o "$OUT/cuda_harness"
"$OUT/cuda_harness"
