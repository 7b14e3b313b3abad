// CPU arithmetic of the tf_poseidon kernels. Element loops are written to auto-vectorise (see
// convert.h) and are split over TensorFlow's intra-op thread pool in blocks of kBlock elements;
// the SFB product is Eigen's GEMM on tiles of the output, the tiles split over the same pool.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <vector>

#include "poseidon_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "Eigen/Core"

namespace poseidon {

using CPUDevice = Eigen::ThreadPoolDevice;

namespace {

// Elements per unit of parallel work: large enough to amortise scheduling, small enough to
// balance two cores on a 1 MB tensor.
constexpr int64_t kBlock = 1 << 14;

// Calls fn(begin, end) on disjoint ranges covering [0, total), in parallel on the intra-op pool;
// cost_per_element is a rough cycle count used by the pool to decide how finely to split.
template <typename Fn>
void ParallelRanges(OpKernelContext* ctx, int64_t total, int64_t cost_per_element, const Fn& fn) {
  const int64_t blocks = (total + kBlock - 1) / kBlock;
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      blocks, kBlock * cost_per_element, [&](int64_t first, int64_t last) {
        fn(first * kBlock, std::min(last * kBlock, total));
      });
}

template <typename In, typename Out>
void ConvertRange(const typename In::Storage* __restrict src, typename Out::Storage* __restrict dst,
                  int64_t size, float scale) {
  for (int64_t i = 0; i < size; ++i) dst[i] = ScaleConvert<In, Out>(src[i], scale);
}

// Elements [offset, offset + size) of one job.
void RunJobPart(const ConvertJob& job, int64_t offset, int64_t size, float scale) {
  VisitDtype(job.src_type, [&](auto in) {
    VisitDtype(job.dst_type, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      ConvertRange<In, Out>(static_cast<const typename In::Storage*>(job.src) + offset,
                            static_cast<typename Out::Storage*>(job.dst) + offset, size, scale);
    });
  });
}

}  // namespace

template <>
void Backend<CPUDevice>::Convert(OpKernelContext* ctx, const std::vector<ConvertJob>& jobs,
                                 float scale) {
  // starts[i]: index of job i's first element in the concatenation of all jobs.
  std::vector<int64_t> starts(jobs.size() + 1, 0);
  for (size_t i = 0; i < jobs.size(); ++i) starts[i + 1] = starts[i] + jobs[i].size;
  ParallelRanges(ctx, starts.back(), /*cost_per_element=*/4, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; begin < end; ++i) {
      const int64_t part_end = std::min(end, starts[i + 1]);
      RunJobPart(jobs[i], begin - starts[i], part_end - begin, scale);
      begin = part_end;
    }
  });
}

namespace {

// Sub-block of SumRange: an accumulator that stays in L1.
constexpr int64_t kSumBlock = 1024;

template <typename Wire, typename Out>
void SumRange(const typename Wire::Storage* __restrict chunks, int64_t num_chunks, int64_t n,
              int64_t begin, int64_t end, float scale, typename Out::Storage* __restrict out) {
  float acc[kSumBlock];
  for (int64_t start = begin; start < end; start += kSumBlock) {
    const int64_t size = std::min(kSumBlock, end - start);
    std::fill(acc, acc + size, 0.0f);
    for (int64_t p = 0; p < num_chunks; ++p) {
      const typename Wire::Storage* chunk = chunks + p * n + start;
      for (int64_t j = 0; j < size; ++j) acc[j] += Wire::ToFloat(chunk[j]);
    }
    for (int64_t j = 0; j < size; ++j) out[start + j] = Out::FromFloat(acc[j] * scale);
  }
}

// Output tile of SfbReconstruct, one Eigen GEMM each: 64 rows by up to 4096 columns measured
// up to 1.1x faster than one Eigen tensor contraction over the same pool, and faster than 2-D
// tiles (docs/kernels.md).
constexpr int64_t kSfbTileRows = 64;
constexpr int64_t kSfbTileCols = 4096;

// Points *result at `tensor` as float32 times `scale`: `tensor` itself when it is float32 and
// scale is 1, else `*temp`, a converted copy.
Status AsScaledFloat(OpKernelContext* ctx, const Tensor& tensor, float scale, Tensor* temp,
                     const Tensor** result) {
  *result = &tensor;
  if (tensor.dtype() == ::tensorflow::DT_FLOAT && scale == 1.0f) return absl::OkStatus();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_FLOAT, tensor.shape(), temp));
  ConvertJob job;
  TF_RETURN_IF_ERROR(PackedJob(tensor, *temp, 0, /*to_packed=*/true, &job));
  Backend<CPUDevice>::Convert(ctx, {job}, scale);
  *result = temp;
  return absl::OkStatus();
}

}  // namespace

template <>
void Backend<CPUDevice>::SumChunks(OpKernelContext* ctx, const Tensor& chunks, float scale,
                                   Tensor* out) {
  Dtype wire_type;
  Dtype out_type;
  OP_REQUIRES_OK(ctx, ToDtype(chunks.dtype(), &wire_type));
  OP_REQUIRES_OK(ctx, ToDtype(out->dtype(), &out_type));
  const int64_t num_chunks = chunks.dim_size(0);
  const int64_t n = chunks.dim_size(1);
  ParallelRanges(ctx, n, /*cost_per_element=*/2 * num_chunks + 2, [&](int64_t begin, int64_t end) {
    VisitDtype(wire_type, [&](auto wire) {
      VisitDtype(out_type, [&](auto out_tag) {
        using Wire = decltype(wire);
        using Out = decltype(out_tag);
        SumRange<Wire, Out>(static_cast<const typename Wire::Storage*>(chunks.data()), num_chunks,
                            n, begin, end, scale, static_cast<typename Out::Storage*>(out->data()));
      });
    });
  });
}

template <>
void Backend<CPUDevice>::SfbReconstruct(OpKernelContext* ctx, const Tensor& u, const Tensor& v,
                                        float scale, Tensor* out) {
  Tensor u_temp;
  Tensor v_temp;
  const Tensor* u_float;
  const Tensor* v_float;
  OP_REQUIRES_OK(ctx, AsScaledFloat(ctx, u, scale, &u_temp, &u_float));
  OP_REQUIRES_OK(ctx, AsScaledFloat(ctx, v, 1.0f, &v_temp, &v_float));
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int64_t rows = u.dim_size(0);
  const int64_t m = u.dim_size(1);
  const int64_t n = v.dim_size(1);
  const Eigen::Map<const RowMajor> u_map(u_float->flat<float>().data(), rows, m);
  const Eigen::Map<const RowMajor> v_map(v_float->flat<float>().data(), rows, n);
  Eigen::Map<RowMajor> grad(out->flat<float>().data(), m, n);
  const int64_t tiles_n = (n + kSfbTileCols - 1) / kSfbTileCols;
  const int64_t tiles = (m + kSfbTileRows - 1) / kSfbTileRows * tiles_n;
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      tiles, 2 * rows * kSfbTileRows * kSfbTileCols, [&](int64_t first, int64_t last) {
        for (int64_t tile = first; tile < last; ++tile) {
          const int64_t m0 = tile / tiles_n * kSfbTileRows;
          const int64_t n0 = tile % tiles_n * kSfbTileCols;
          const int64_t tile_m = std::min(kSfbTileRows, m - m0);
          const int64_t tile_n = std::min(kSfbTileCols, n - n0);
          grad.block(m0, n0, tile_m, tile_n).noalias() =
              u_map.block(0, m0, rows, tile_m).transpose() * v_map.block(0, n0, rows, tile_n);
        }
      });
}

}  // namespace poseidon

POSEIDON_REGISTER_KERNELS(::tensorflow::DEVICE_CPU, ::poseidon::CPUDevice);
