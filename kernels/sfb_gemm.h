// SFB reconstruction as one column-major (BLAS) GEMM: shared by the TensorFlow GPU kernel, which
// calls TensorFlow's own cuBLAS through StreamExecutor (poseidon_kernels_gpu.cc), and the CUDA
// harness, which calls cuBLAS directly (cuda_harness.cu). No TensorFlow, no CUDA dependency.
//
// out [M, N] = scale * u^T v with u [R, M], v [R, N], all row-major. A row-major X is the
// column-major X^T, so column-major out^T [N, M] = v^T u is C = alpha * op(A) op(B) with
//   A = v's memory as column-major [N, R] (lda = N), op(A) = A;
//   B = u's memory as column-major [M, R] (ldb = M), op(B) = B^T;
//   C = out's memory as column-major [N, M] (ldc = N); m = N, n = M, k = R, alpha = scale.
#ifndef TF_POSEIDON_KERNELS_SFB_GEMM_H_
#define TF_POSEIDON_KERNELS_SFB_GEMM_H_

#include <cstdint>

namespace poseidon {

// cuBLAS takes int dimensions: R, M and N must each be at most this (any device, so that a
// model that runs on a CPU runs on a GPU too).
constexpr int64_t kMaxGemmDim = 2147483647;

struct SfbGemm {
  int64_t m, n, k;       // BLAS m, n, k: N, M, R
  int64_t lda, ldb, ldc;  // N, M, N

  static SfbGemm For(int64_t rows, int64_t m, int64_t n) { return {n, m, rows, n, m, n}; }
};

}  // namespace poseidon

#endif  // TF_POSEIDON_KERNELS_SFB_GEMM_H_
