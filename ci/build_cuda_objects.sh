#!/usr/bin/env bash
# Compiles the CUDA side of the kernels to objects; needs nvcc, no GPU. Each kernels/*.cu goes
# through nvcc with TensorFlow's compile flags and -std=c++17; the GPU registration
# (kernels/poseidon_kernels_gpu.cc, empty unless GOOGLE_CUDA) through the host compiler with
# GOOGLE_CUDA=1, as in a build against a CUDA TensorFlow. The compilers run side by side;
# exits non-zero if any of them fails (after all have ended).
#
#   ci/build_cuda_objects.sh [OUT_DIR]      # default build/cuda_objects
# Environment: PYTHON (a Python with TensorFlow; default .venv/bin/python, else python3),
# NVCC (default nvcc), CUDA_HOME (default /usr/local/cuda, else two levels above the real nvcc),
# CXX (default g++).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
NVCC=${NVCC:-nvcc}
if [ -z "${CUDA_HOME:-}" ]; then
    CUDA_HOME=/usr/local/cuda
    if [ ! -d "$CUDA_HOME/include" ]; then
        CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")
    fi
fi
OUT=${1:-build/cuda_objects}
mkdir -p "$OUT"
TF_CFLAGS=$("$PYTHON" -c \
    'import tensorflow as tf; print(" ".join(tf.sysconfig.get_compile_flags()))' 2>/dev/null)
read -r -a TF_CFLAGS <<< "$TF_CFLAGS"
"$NVCC" --version | tail -1
pids=()
for source in kernels/*.cu; do
    echo "nvcc: $source"
    "$NVCC" -std=c++17 -O3 -ftz=true -fmad=false -Xcompiler -fPIC "${TF_CFLAGS[@]}" -Ikernels \
        -c "$source" -o "$OUT/$(basename "$source").o" &
    pids+=($!)
done
echo "${CXX:-g++} -DGOOGLE_CUDA=1: kernels/poseidon_kernels_gpu.cc"
"${CXX:-g++}" -std=c++17 -O2 -fPIC -Wno-deprecated-declarations -Wno-interference-size \
    "${TF_CFLAGS[@]}" -DGOOGLE_CUDA=1 -I"$CUDA_HOME/include" -Ikernels \
    -c kernels/poseidon_kernels_gpu.cc \
    -o "$OUT/poseidon_kernels_gpu.cc.o" &
pids+=($!)
failed=0
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
[ "$failed" = 0 ] || { echo "failed: see the compiler messages above" >&2; exit 1; }
echo "ok: objects in $OUT"
