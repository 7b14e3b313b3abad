#!/usr/bin/env bash
# For a machine with an NVIDIA GPU and the CUDA toolkit (no TensorFlow needed): builds the
# standalone harness kernels/cuda_harness.cu with the CUDA kernels for the local GPU and runs it:
# every launcher against the CPU kernels' loops, bit for bit (PASS/FAIL lines), the SFB GEMM
# mapping through cuBLAS (when the toolkit has it), then timings as markdown table rows.
# Exit status: the harness's (0 iff every check passed), or the compiler's.
#
#   ci/check_cuda_on_gpu.sh [OUT_DIR]       # default build/cuda_harness
# Environment: NVCC (default nvcc), CUDA_ARCH (default native: the GPU of this machine),
# CUDA_HOME (default: two levels above the real nvcc), CUBLAS_FLAGS (default -lcublas when
# $CUDA_HOME/include/cublas_v2.h exists).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")}
OUT=${1:-build/cuda_harness}
mkdir -p "$OUT"
if [ -z "${CUBLAS_FLAGS+x}" ]; then
    CUBLAS_FLAGS=""
    if [ -f "$CUDA_HOME/include/cublas_v2.h" ]; then CUBLAS_FLAGS="-lcublas"; fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$NVCC" --version | tail -1
# -ftz=true -fmad=false: as kernels/build.py compiles the kernels for TensorFlow.
# shellcheck disable=SC2086
"$NVCC" -std=c++17 -O3 -ftz=true -fmad=false -arch="${CUDA_ARCH:-native}" -Ikernels \
    kernels/cuda_harness.cu kernels/poseidon_cuda.cu $CUBLAS_FLAGS -o "$OUT/cuda_harness"
"$OUT/cuda_harness"
