// Launcher API of the tf_poseidon CUDA kernels (implemented in poseidon_cuda.cu).
//
// Plain C++: no TensorFlow and no CUDA header is needed to call it, so the same kernels serve the
// TensorFlow GPU op (poseidon_kernels_gpu.cc, compiled by the host compiler) and the standalone
// harness (cuda_harness.cu). Every pointer is device memory; every launcher only enqueues work on
// `stream` (asynchronous) and returns nullptr on success or an error string. SFB reconstruction
// has no launcher here: it is one cuBLAS GEMM (sfb_gemm.h).
#ifndef TF_POSEIDON_KERNELS_POSEIDON_CUDA_H_
#define TF_POSEIDON_KERNELS_POSEIDON_CUDA_H_

#include <cstdint>

#include "convert.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*.

namespace poseidon {
namespace cuda {

// Runs jobs[0..count): dst[i] = dst_type(src_type(src[i]) * scale) (pack and unpack).
const char* LaunchConvert(const ConvertJob* jobs, int64_t count, float scale, CUstream_st* stream);

// out[j] = out_type(scale * sum_{p<num_chunks} chunks[p * n + j]), accumulated in float32 in
// order p = 0, 1, ...; chunks [num_chunks, n] of wire_type, out [n] of out_type. A NaN result is
// CanonicalNaN's (convert.h), as on the CPU.
const char* LaunchSumChunks(const void* chunks, Dtype wire_type, int64_t num_chunks, int64_t n,
                            float scale, void* out, Dtype out_type, CUstream_st* stream);

}  // namespace cuda
}  // namespace poseidon

#endif  // TF_POSEIDON_KERNELS_POSEIDON_CUDA_H_
