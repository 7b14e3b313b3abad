// Device-independent part of the tf_poseidon op kernels: input validation, output allocation and
// the description of the work. The arithmetic is done by Backend<Device>, specialised for the CPU
// in poseidon_kernels_cpu.cc and for CUDA GPUs in poseidon_kernels_gpu.cc, each of which then
// registers the kernels with POSEIDON_REGISTER_KERNELS.
#ifndef TF_POSEIDON_KERNELS_POSEIDON_KERNELS_H_
#define TF_POSEIDON_KERNELS_POSEIDON_KERNELS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "convert.h"
#include "sfb_gemm.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace poseidon {

using ::tensorflow::DataType;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using Status = absl::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

// The arithmetic of the ops on one device type; every function reports failures through ctx.
template <typename Device>
struct Backend {
  // Runs every job (see ConvertJob) with the same scale.
  static void Convert(OpKernelContext* ctx, const std::vector<ConvertJob>& jobs, float scale);
  // out[j] = out_dtype(scale * sum_p chunks[p, j]) accumulated in float32; chunks [P, n], out [n].
  static void SumChunks(OpKernelContext* ctx, const Tensor& chunks, float scale, Tensor* out);
  // out = scale * u^T v in float32; u [R, M], v [R, N] of one dtype, out float32 [M, N].
  static void SfbReconstruct(OpKernelContext* ctx, const Tensor& u, const Tensor& v, float scale,
                             Tensor* out);
};

inline Status ToDtype(DataType type, Dtype* dtype) {
  switch (type) {
    case ::tensorflow::DT_FLOAT:
      *dtype = Dtype::kFloat32;
      return absl::OkStatus();
    case ::tensorflow::DT_HALF:
      *dtype = Dtype::kFloat16;
      return absl::OkStatus();
    case ::tensorflow::DT_BFLOAT16:
      *dtype = Dtype::kBFloat16;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "expected float32, float16 or bfloat16, got ", ::tensorflow::DataTypeString(type)));
  }
}

// The float32 scalar input `name`.
inline Status ReadScale(OpKernelContext* ctx, const char* name, float* scale) {
  const Tensor* tensor;
  TF_RETURN_IF_ERROR(ctx->input(name, &tensor));
  if (tensor->dtype() != ::tensorflow::DT_FLOAT ||
      !::tensorflow::TensorShapeUtils::IsScalar(tensor->shape())) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be a float32 scalar, got shape ",
                                                 tensor->shape().DebugString()));
  }
  *scale = tensor->scalar<float>()();
  return absl::OkStatus();
}

// The job that converts `tensor` to or from elements [offset, offset + tensor.NumElements()) of
// the 1-D `packed`.
inline Status PackedJob(const Tensor& tensor, const Tensor& packed, int64_t offset, bool to_packed,
                        ConvertJob* job) {
  Dtype tensor_type;
  Dtype packed_type;
  TF_RETURN_IF_ERROR(ToDtype(tensor.dtype(), &tensor_type));
  TF_RETURN_IF_ERROR(ToDtype(packed.dtype(), &packed_type));
  char* packed_at = static_cast<char*>(packed.data()) +
                    offset * static_cast<int64_t>(::tensorflow::DataTypeSize(packed.dtype()));
  job->size = tensor.NumElements();
  job->src = to_packed ? tensor.data() : packed_at;
  job->dst = to_packed ? packed_at : tensor.data();
  job->src_type = to_packed ? tensor_type : packed_type;
  job->dst_type = to_packed ? packed_type : tensor_type;
  return absl::OkStatus();
}

template <typename Device>
class PackOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    float scale;
    OP_REQUIRES_OK(ctx, ReadScale(ctx, "scale", &scale));
    int64_t total = 0;
    for (const Tensor& tensor : tensors) total += tensor.NumElements();
    Tensor* packed;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &packed));
    std::vector<ConvertJob> jobs;
    int64_t offset = 0;
    for (const Tensor& tensor : tensors) {
      if (tensor.NumElements() == 0) continue;
      ConvertJob job;
      OP_REQUIRES_OK(ctx, PackedJob(tensor, *packed, offset, /*to_packed=*/true, &job));
      jobs.push_back(job);
      offset += tensor.NumElements();
    }
    Backend<Device>::Convert(ctx, jobs, scale);
  }
};

template <typename Device>
class UnpackOp : public OpKernel {
 public:
  explicit UnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<::tensorflow::PartialTensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes));
    OP_REQUIRES(ctx, static_cast<int>(shapes.size()) == ctx->num_outputs(),
                absl::InvalidArgumentError(absl::StrCat("shapes has ", shapes.size(),
                                                      " entries but out_types has ",
                                                      ctx->num_outputs())));
    for (const auto& shape : shapes) {
      TensorShape full;
      OP_REQUIRES(ctx, shape.AsTensorShape(&full),
                  absl::InvalidArgumentError(absl::StrCat("shapes must be fully defined, got ",
                                                        shape.DebugString())));
      total_ += full.num_elements();
      shapes_.push_back(full);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(ctx,
                ::tensorflow::TensorShapeUtils::IsVector(packed.shape()) &&
                    packed.NumElements() == total_,
                absl::InvalidArgumentError(absl::StrCat(
                    "packed must have shape [", total_, "] (the sum of the output sizes), got ",
                    packed.shape().DebugString())));
    float unscale;
    OP_REQUIRES_OK(ctx, ReadScale(ctx, "unscale", &unscale));
    std::vector<ConvertJob> jobs;
    int64_t offset = 0;
    for (int i = 0; i < static_cast<int>(shapes_.size()); ++i) {
      Tensor* tensor;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shapes_[i], &tensor));
      if (tensor->NumElements() == 0) continue;
      ConvertJob job;
      OP_REQUIRES_OK(ctx, PackedJob(*tensor, packed, offset, /*to_packed=*/false, &job));
      jobs.push_back(job);
      offset += tensor->NumElements();
    }
    Backend<Device>::Convert(ctx, jobs, unscale);
  }

 private:
  std::vector<TensorShape> shapes_;
  int64_t total_ = 0;
};

template <typename Device>
class SumChunksOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& chunks = ctx->input(0);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsMatrix(chunks.shape()),
                absl::InvalidArgumentError(absl::StrCat("chunks must have shape [P, n], got ",
                                                      chunks.shape().DebugString())));
    float scale;
    OP_REQUIRES_OK(ctx, ReadScale(ctx, "scale", &scale));
    Tensor* sum;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({chunks.dim_size(1)}), &sum));
    if (sum->NumElements() == 0) return;
    Backend<Device>::SumChunks(ctx, chunks, scale, sum);
  }
};

template <typename Device>
class SfbReconstructOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& v = ctx->input(1);
    OP_REQUIRES(ctx,
                ::tensorflow::TensorShapeUtils::IsMatrix(u.shape()) &&
                    ::tensorflow::TensorShapeUtils::IsMatrix(v.shape()) &&
                    u.dim_size(0) == v.dim_size(0),
                absl::InvalidArgumentError(absl::StrCat(
                    "u must have shape [R, M] and v shape [R, N] with the same R, got u ",
                    u.shape().DebugString(), " and v ", v.shape().DebugString())));
    OP_REQUIRES(ctx,
                u.dim_size(0) <= kMaxGemmDim && u.dim_size(1) <= kMaxGemmDim &&
                    v.dim_size(1) <= kMaxGemmDim,
                absl::InvalidArgumentError(absl::StrCat(
                    "u [R, M] and v [R, N] must have R, M and N below 2^31 (a GEMM's int "
                    "dimensions), got u ",
                    u.shape().DebugString(), " and v ", v.shape().DebugString())));
    float scale;
    OP_REQUIRES_OK(ctx, ReadScale(ctx, "scale", &scale));
    Tensor* grad;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({u.dim_size(1), v.dim_size(1)}), &grad));
    if (grad->NumElements() == 0) return;
    Backend<Device>::SfbReconstruct(ctx, u, v, scale, grad);
  }
};

}  // namespace poseidon

// Registers the four kernels for one device; `scale` inputs always live in host memory.
#define POSEIDON_REGISTER_KERNELS(DEVICE_NAME, DeviceType)                                    \
  REGISTER_KERNEL_BUILDER(Name("PoseidonPack").Device(DEVICE_NAME).HostMemory("scale"),       \
                          ::poseidon::PackOp<DeviceType>);                                    \
  REGISTER_KERNEL_BUILDER(Name("PoseidonUnpack").Device(DEVICE_NAME).HostMemory("unscale"),   \
                          ::poseidon::UnpackOp<DeviceType>);                                  \
  REGISTER_KERNEL_BUILDER(Name("PoseidonSumChunks").Device(DEVICE_NAME).HostMemory("scale"),  \
                          ::poseidon::SumChunksOp<DeviceType>);                               \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("PoseidonSfbReconstruct").Device(DEVICE_NAME).HostMemory("scale"),                 \
      ::poseidon::SfbReconstructOp<DeviceType>)

#endif  // TF_POSEIDON_KERNELS_POSEIDON_KERNELS_H_
