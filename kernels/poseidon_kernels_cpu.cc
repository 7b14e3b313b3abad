// CPU arithmetic of the tf_poseidon kernels: the element loops of cpu_loops.h, split over
// TensorFlow's intra-op thread pool in blocks of kBlock elements; the SFB product is Eigen's GEMM on tiles of the output, the tiles split over the same pool.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_loops.h"
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
    SumChunksPart(wire_type, out_type, chunks.data(), num_chunks, n, begin, end, scale,
                  out->data());
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
