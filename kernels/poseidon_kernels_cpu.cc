// CPU arithmetic of the tf_poseidon kernels: the element loops of cpu_loops.h, split over
// TensorFlow's intra-op thread pool in blocks of kBlock elements; the SFB product is Eigen's GEBP
// micro-kernel on row tiles of the output, the tiles split over the same pool.
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

// SfbReconstruct works on the column-major view of its row-major output: out^T [N, M] = A B with
// A = v^T [N, R] (v's memory read column-major) and B = u [R, M]. A is packed for Eigen's GEBP
// micro-kernel once and shared by every task; each task computes kSfbTileRows rows of `out`
// (columns of out^T), packing only its slice of B. One Eigen GEMM per output tile (the previous
// version) re-packed all of A for every tile, which cost 5-15% of the time (docs/kernels.md).
constexpr int64_t kSfbTileRows = 32;
// Depth (R) per packed block: A's micro-panels (mr x kSfbDepthBlock floats) stay in L1.
constexpr int64_t kSfbDepthBlock = 256;

// Points *result at `tensor` as float32: `tensor` itself when it is float32, else `*temp`, a
// converted copy.
Status AsFloat(OpKernelContext* ctx, const Tensor& tensor, Tensor* temp, const Tensor** result) {
  *result = &tensor;
  if (tensor.dtype() == ::tensorflow::DT_FLOAT) return absl::OkStatus();
  TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_FLOAT, tensor.shape(), temp));
  ConvertJob job;
  TF_RETURN_IF_ERROR(PackedJob(tensor, *temp, 0, /*to_packed=*/true, &job));
  Backend<CPUDevice>::Convert(ctx, {job}, 1.0f);
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
  namespace ei = Eigen::internal;
  using Index = Eigen::Index;
  using Traits = ei::gebp_traits<float, float>;
  using LhsMapper = ei::const_blas_data_mapper<float, Index, Eigen::ColMajor>;
  using RhsMapper = ei::const_blas_data_mapper<float, Index, Eigen::RowMajor>;
  using ResMapper = ei::blas_data_mapper<float, Index, Eigen::ColMajor>;
  Tensor u_temp;
  Tensor v_temp;
  const Tensor* u_float;
  const Tensor* v_float;
  OP_REQUIRES_OK(ctx, AsFloat(ctx, u, &u_temp, &u_float));
  OP_REQUIRES_OK(ctx, AsFloat(ctx, v, &v_temp, &v_float));
  const Index depth = u.dim_size(0);  // R
  const Index m = u.dim_size(1);
  const Index n = v.dim_size(1);
  float* result = out->flat<float>().data();
  if (depth == 0) {
    std::fill(result, result + m * n, 0.0f);
    return;
  }
  const LhsMapper lhs(v_float->flat<float>().data(), n);  // A(i, r) = v[r, i]
  const RhsMapper rhs(u_float->flat<float>().data(), m);  // B(r, j) = u[r, j]
  const ResMapper res(result, n);                          // out^T(i, j) = out[j, i]

  // A packed once, depth block by depth block: block k holds A[:, k*D : k*D + kc] for GEBP.
  Tensor packed_a;
  OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({n * depth}),
                                         &packed_a));
  float* blocks_a = packed_a.flat<float>().data();
  ei::gemm_pack_lhs<float, Index, LhsMapper, Traits::mr, Traits::LhsProgress,
                    Traits::LhsPacket4Packing, Eigen::ColMajor>
      pack_lhs;
  for (Index k = 0; k < depth; k += kSfbDepthBlock) {
    const Index kc = std::min(kSfbDepthBlock, depth - k);
    pack_lhs(blocks_a + n * k, lhs.getSubMapper(0, k), kc, n);
  }

  const Index tiles = (m + kSfbTileRows - 1) / kSfbTileRows;
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      tiles, 2 * depth * kSfbTileRows * n, [&](int64_t first, int64_t last) {
        ei::gemm_pack_rhs<float, Index, RhsMapper, Traits::nr, Eigen::RowMajor> pack_rhs;
        ei::gebp_kernel<float, float, Index, ResMapper, Traits::mr, Traits::nr, false, false> gebp;
        float* block_b = static_cast<float*>(
            ei::aligned_malloc(sizeof(float) * std::min(kSfbDepthBlock, depth) * kSfbTileRows));
        for (int64_t tile = first; tile < last; ++tile) {
          const Index j0 = tile * kSfbTileRows;
          const Index cols = std::min(kSfbTileRows, m - j0);
          std::fill(result + j0 * n, result + (j0 + cols) * n, 0.0f);
          for (Index k = 0; k < depth; k += kSfbDepthBlock) {
            const Index kc = std::min(kSfbDepthBlock, depth - k);
            pack_rhs(block_b, rhs.getSubMapper(k, j0), kc, cols);
            gebp(res.getSubMapper(0, j0), blocks_a + n * k, block_b, n, kc, cols, scale);
          }
        }
        ei::aligned_free(block_b);
      });
}

}  // namespace poseidon

POSEIDON_REGISTER_KERNELS(::tensorflow::DEVICE_CPU, ::poseidon::CPUDevice);
