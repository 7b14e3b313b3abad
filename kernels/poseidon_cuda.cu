// CUDA kernels of tf_poseidon behind the launcher API of poseidon_cuda.h. Plain CUDA: no
// TensorFlow header, so nvcc never parses TensorFlow and the harness links without TensorFlow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "convert.h"
#include "poseidon_cuda.h"

namespace poseidon {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Elements of one job converted by one thread block.
constexpr int64_t kConvertBlockElements = 16 * kThreads;
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
      const auto* src = static_cast<const typename In::Storage*>(job.src);
      auto* dst = static_cast<typename Out::Storage*>(job.dst);
      for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        dst[i] = ScaleConvert<In, Out>(src[i], batch.scale);
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
    out[j] = Out::FromFloat(acc * scale);
  }
}

// SFB tiling: a block of kSide x kSide threads computes a kTile x kTile output tile, each thread
// kPerThread x kPerThread outputs, stepping through the rows of u and v kTileRows at a time.
constexpr int kSide = 16;
constexpr int kPerThread = 4;
constexpr int kTile = kSide * kPerThread;
constexpr int kTileRows = 16;

template <typename T>
__global__ void SfbReconstructKernel(const typename T::Storage* u, const typename T::Storage* v,
                                     int64_t rows, int64_t m, int64_t n, float scale, float* out) {
  __shared__ float u_tile[kTileRows][kTile];
  __shared__ float v_tile[kTileRows][kTile];
  const int64_t tiles_n = CeilDiv(n, kTile);
  const int64_t m0 = (blockIdx.x / tiles_n) * kTile;
  const int64_t n0 = (blockIdx.x % tiles_n) * kTile;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  float acc[kPerThread][kPerThread] = {};
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    for (int k = ty * kSide + tx; k < kTileRows * kTile; k += kSide * kSide) {
      const int64_t r = r0 + k / kTile;
      const int64_t col = k % kTile;
      const bool in_u = r < rows && m0 + col < m;
      const bool in_v = r < rows && n0 + col < n;
      u_tile[k / kTile][col] = in_u ? T::ToFloat(u[r * m + m0 + col]) * scale : 0.0f;
      v_tile[k / kTile][col] = in_v ? T::ToFloat(v[r * n + n0 + col]) : 0.0f;
    }
    __syncthreads();
    for (int r = 0; r < kTileRows; ++r) {
      float a[kPerThread];
      float b[kPerThread];
      for (int i = 0; i < kPerThread; ++i) a[i] = u_tile[r][ty + kSide * i];
      for (int j = 0; j < kPerThread; ++j) b[j] = v_tile[r][tx + kSide * j];
      for (int i = 0; i < kPerThread; ++i) {
        for (int j = 0; j < kPerThread; ++j) acc[i][j] += a[i] * b[j];
      }
    }
    __syncthreads();
  }
  for (int i = 0; i < kPerThread; ++i) {
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t row = m0 + ty + kSide * i;
      const int64_t col = n0 + tx + kSide * j;
      if (row < m && col < n) out[row * n + col] = acc[i][j];
    }
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

const char* LaunchSfbReconstruct(const void* u, const void* v, Dtype type, int64_t rows, int64_t m,
                                 int64_t n, float scale, float* out, CUstream_st* stream) {
  const int64_t tiles = CeilDiv(m, kTile) * CeilDiv(n, kTile);
  if (tiles == 0) return nullptr;
  VisitDtype(type, [&](auto tag) {
    using T = decltype(tag);
    SfbReconstructKernel<T><<<tiles, dim3(kSide, kSide), 0, stream>>>(
        static_cast<const typename T::Storage*>(u), static_cast<const typename T::Storage*>(v),
        rows, m, n, scale, out);
  });
  return LastError();
}

}  // namespace cuda
}  // namespace poseidon
