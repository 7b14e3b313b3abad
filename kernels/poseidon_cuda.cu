// CUDA kernels of tf_poseidon behind the launcher API of poseidon_cuda.h. Plain CUDA: no
// TensorFlow header, so nvcc never parses TensorFlow and the harness links without TensorFlow.
// Compiled with -ftz=true -fmad=false (kernels/build.py), so that the element arithmetic of
// convert.h gives the CPU kernels' bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "convert.h"
#include "poseidon_cuda.h"

namespace poseidon {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Loads each thread issues before its first store: enough bytes in flight to approach the memory
// bandwidth (a single load per thread at a time leaves most of it idle).
constexpr int kUnroll = 8;
// Elements of one job converted by one thread block.
constexpr int64_t kConvertBlockElements = 2 * kUnroll * kThreads;
// Jobs per kernel launch: the batch travels as a kernel parameter (< 4 KB).
constexpr int kJobsPerLaunch = 64;

struct JobBatch {
  ConvertJob jobs[kJobsPerLaunch];
  // first_block[j]: the first thread block of jobs[j]; first_block[count] = total blocks.
  int64_t first_block[kJobsPerLaunch + 1];
  int count;
  float scale;
};

const char* LastError() {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

__host__ __device__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One block converts kConvertBlockElements consecutive elements of one job.
__global__ void ConvertKernel(const __grid_constant__ JobBatch batch) {
  int lo = 0;
  int hi = batch.count - 1;
  while (lo < hi) {  // the last job whose first block is <= blockIdx.x
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_block[mid] <= static_cast<int64_t>(blockIdx.x)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const ConvertJob& job = batch.jobs[lo];
  const int64_t begin = (blockIdx.x - batch.first_block[lo]) * kConvertBlockElements;
  const int64_t end = min(begin + kConvertBlockElements, job.size);
  VisitDtype(job.src_type, [&](auto in) {
    VisitDtype(job.dst_type, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const auto* __restrict__ src = static_cast<const typename In::Storage*>(job.src);
      auto* __restrict__ dst = static_cast<typename Out::Storage*>(job.dst);
      for (int64_t base = begin + threadIdx.x; base < end; base += kUnroll * blockDim.x) {
        typename In::Storage x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + u * static_cast<int64_t>(blockDim.x);
          if (i < end) x[u] = src[i];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + u * static_cast<int64_t>(blockDim.x);
          if (i < end) dst[i] = ScaleConvert<In, Out>(x[u], batch.scale);
        }
      }
    });
  });
}

template <typename Wire, typename Out>
__global__ void SumChunksKernel(const typename Wire::Storage* chunks, int64_t num_chunks,
                                int64_t n, float scale, typename Out::Storage* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += stride) {
    float acc = 0.0f;
    for (int64_t p = 0; p < num_chunks; ++p) acc += Wire::ToFloat(chunks[p * n + j]);
    out[j] = Out::FromFloat(CanonicalNaN(acc * scale));
  }
}

}  // namespace

const char* LaunchConvert(const ConvertJob* jobs, int64_t count, float scale,
                          CUstream_st* stream) {
  for (int64_t first = 0; first < count; first += kJobsPerLaunch) {
    JobBatch batch{};
    batch.count = static_cast<int>(std::min<int64_t>(kJobsPerLaunch, count - first));
    batch.scale = scale;
    for (int j = 0; j < batch.count; ++j) {
      batch.jobs[j] = jobs[first + j];
      batch.first_block[j + 1] =
          batch.first_block[j] + CeilDiv(batch.jobs[j].size, kConvertBlockElements);
    }
    const int64_t blocks = batch.first_block[batch.count];
    if (blocks > 0) ConvertKernel<<<blocks, kThreads, 0, stream>>>(batch);
  }
  return LastError();
}

const char* LaunchSumChunks(const void* chunks, Dtype wire_type, int64_t num_chunks, int64_t n,
                            float scale, void* out, Dtype out_type, CUstream_st* stream) {
  if (n == 0) return nullptr;
  const int64_t blocks = std::min<int64_t>(CeilDiv(n, kThreads), 1 << 16);
  VisitDtype(wire_type, [&](auto wire) {
    VisitDtype(out_type, [&](auto out_tag) {
      using Wire = decltype(wire);
      using Out = decltype(out_tag);
      SumChunksKernel<Wire, Out><<<blocks, kThreads, 0, stream>>>(
          static_cast<const typename Wire::Storage*>(chunks), num_chunks, n, scale,
          static_cast<typename Out::Storage*>(out));
    });
  });
  return LastError();
}

}  // namespace cuda
}  // namespace poseidon
