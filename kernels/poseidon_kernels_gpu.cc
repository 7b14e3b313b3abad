// GPU registration of the tf_poseidon kernels: Backend<GpuDevice> forwards pack, unpack and
// sum_chunks to the CUDA launchers of poseidon_cuda.h on the op's stream, and runs SFB
// reconstruction as one GEMM of TensorFlow's own cuBLAS, reached through the op's StreamExecutor
// (the BLAS that TensorFlow's MatMul uses: same library, handle and stream, nothing to link).
// Compiled by the host compiler; empty unless the library is built with GOOGLE_CUDA=1
// (kernels/build.py does so for a CUDA-enabled TensorFlow).
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <vector>

#include "poseidon_cuda.h"
#include "poseidon_kernels.h"
#include "sfb_gemm.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tsl/platform/tensor_float_32_utils.h"
#include "unsupported/Eigen/CXX11/Tensor"
#include "xla/stream_executor/blas.h"
#include "xla/stream_executor/device_address.h"
#include "xla/stream_executor/engine_options.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace poseidon {

using GPUDevice = Eigen::GpuDevice;
namespace se = ::stream_executor;

namespace {

CUstream_st* StreamOf(OpKernelContext* ctx) { return ctx->eigen_device<GPUDevice>().stream(); }

// Turns a launcher's error string into the op's status.
void CheckLaunch(OpKernelContext* ctx, const char* error) {
  OP_REQUIRES(ctx, error == nullptr,
              absl::InternalError(absl::StrCat("tf_poseidon CUDA kernel launch failed: ", error)));
}

se::blas::DataType BlasType(DataType type) {
  switch (type) {
    case ::tensorflow::DT_HALF:
      return se::blas::DataType::kHalf;
    case ::tensorflow::DT_BFLOAT16:
      return se::blas::DataType::kBF16;
    default:
      return se::blas::DataType::kFloat;
  }
}

se::DeviceAddressBase AddressOf(const Tensor& tensor) {
  return se::DeviceAddressBase(const_cast<void*>(tensor.data()), tensor.TotalBytes());
}

}  // namespace

template <>
void Backend<GPUDevice>::Convert(OpKernelContext* ctx, const std::vector<ConvertJob>& jobs,
                                 float scale) {
  CheckLaunch(ctx, cuda::LaunchConvert(jobs.data(), static_cast<int64_t>(jobs.size()), scale,
                                       StreamOf(ctx)));
}

template <>
void Backend<GPUDevice>::SumChunks(OpKernelContext* ctx, const Tensor& chunks, float scale,
                                   Tensor* out) {
  Dtype wire_type;
  Dtype out_type;
  OP_REQUIRES_OK(ctx, ToDtype(chunks.dtype(), &wire_type));
  OP_REQUIRES_OK(ctx, ToDtype(out->dtype(), &out_type));
  CheckLaunch(ctx, cuda::LaunchSumChunks(chunks.data(), wire_type, chunks.dim_size(0),
                                         chunks.dim_size(1), scale, out->data(), out_type,
                                         StreamOf(ctx)));
}

// 16-bit factors go to cuBLAS as they are (tensor cores, float32 accumulation: their products are
// exact in float32); float32 factors are rounded to TensorFloat-32 on the way exactly when
// TensorFlow's own float32 matmuls are (tf.config.experimental.enable_tensor_float_32_execution,
// on by default), as the local gradient x^T dy that SFB replaces would have been.
template <>
void Backend<GPUDevice>::SfbReconstruct(OpKernelContext* ctx, const Tensor& u, const Tensor& v,
                                        float scale, Tensor* out) {
  se::Stream* stream = ctx->op_device_context()->stream();
  OP_REQUIRES(ctx, stream != nullptr, absl::InternalError("tf_poseidon: no GPU stream"));
  se::DeviceAddressBase c = AddressOf(*out);
  const SfbGemm gemm = SfbGemm::For(u.dim_size(0), u.dim_size(1), v.dim_size(1));
  if (gemm.k == 0) {
    OP_REQUIRES_OK(ctx, stream->MemZero(&c, out->TotalBytes()));
    return;
  }
  se::blas::BlasSupport* blas = stream->parent()->AsBlas();
  OP_REQUIRES(ctx, blas != nullptr,
              absl::InternalError("tf_poseidon: TensorFlow's GPU BLAS is unavailable"));
  const se::blas::DataType type = BlasType(u.dtype());
  const bool tf32 = type == se::blas::DataType::kFloat && tsl::tensor_float_32_execution_enabled();
  const float alpha = scale;
  const float beta = 0.0f;
  OP_REQUIRES_OK(ctx, blas->DoBlasGemmWithAlgorithm(
                          stream, se::blas::Transpose::kNoTranspose,
                          se::blas::Transpose::kTranspose,
                          gemm.m, gemm.n, gemm.k, &alpha, AddressOf(v), type,
                          static_cast<int>(gemm.lda), AddressOf(u), type,
                          static_cast<int>(gemm.ldb), &beta, &c, se::blas::DataType::kFloat,
                          static_cast<int>(gemm.ldc),
                          tf32 ? se::blas::ComputationType::kTF32AsF32
                               : se::blas::ComputationType::kF32,
                          se::blas::kDefaultAlgorithm,
                          se::EngineOptions(/*require_determinism=*/false, /*allow_tf32=*/tf32,
                                            /*require_command_buffer=*/false),
                          /*output_profile_result=*/nullptr, se::blas::CallContext::kNone));
}

}  // namespace poseidon

POSEIDON_REGISTER_KERNELS(::tensorflow::DEVICE_GPU, ::poseidon::GPUDevice);

#endif  // GOOGLE_CUDA
