// GPU registration of the tf_poseidon kernels: Backend<GpuDevice> forwards to the CUDA launchers
// of poseidon_cuda.h on the op's stream. Compiled by the host compiler; empty unless the library
// is built with GOOGLE_CUDA=1 (kernels/build.py does so for a CUDA-enabled TensorFlow).
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <vector>

#include "poseidon_cuda.h"
#include "poseidon_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace poseidon {

using GPUDevice = Eigen::GpuDevice;

namespace {

CUstream_st* StreamOf(OpKernelContext* ctx) { return ctx->eigen_device<GPUDevice>().stream(); }

// Turns a launcher's error string into the op's status.
void CheckLaunch(OpKernelContext* ctx, const char* error) {
  OP_REQUIRES(ctx, error == nullptr,
              absl::InternalError(absl::StrCat("tf_poseidon CUDA kernel launch failed: ", error)));
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

template <>
void Backend<GPUDevice>::SfbReconstruct(OpKernelContext* ctx, const Tensor& u, const Tensor& v,
                                        float scale, Tensor* out) {
  Dtype type;
  OP_REQUIRES_OK(ctx, ToDtype(u.dtype(), &type));
  CheckLaunch(ctx, cuda::LaunchSfbReconstruct(u.data(), v.data(), type, u.dim_size(0),
                                              u.dim_size(1), v.dim_size(1), scale,
                                              out->flat<float>().data(), StreamOf(ctx)));
}

}  // namespace poseidon

POSEIDON_REGISTER_KERNELS(::tensorflow::DEVICE_GPU, ::poseidon::GPUDevice);

#endif  // GOOGLE_CUDA
