// Op definitions and shape functions of the tf_poseidon communication kernels.
// Kernels: poseidon_kernels.h (device-independent part), poseidon_kernels_cpu.cc,
// poseidon_kernels_gpu.cc. Python wrappers and contracts: tf_poseidon/ops.py.
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace poseidon {
namespace {

using Status = absl::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

Status ScalarScale(InferenceContext* c, int index) {
  ShapeHandle unused;
  return c->WithRank(c->input(index), 0, &unused);
}

// packed: [sum of the inputs' element counts], unknown if any input shape is not fully known.
Status PackShape(InferenceContext* c) {
  const int num_tensors = c->num_inputs() - 1;
  TF_RETURN_IF_ERROR(ScalarScale(c, num_tensors));
  int64_t total = 0;
  for (int i = 0; i < num_tensors; ++i) {
    const ShapeHandle shape = c->input(i);
    if (!c->FullyDefined(shape)) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    }
    total += c->Value(c->NumElements(shape));
  }
  c->set_output(0, c->Vector(total));
  return absl::OkStatus();
}

// outputs[i]: shapes[i]; packed must be 1-D with sum(prod(shapes[i])) elements.
Status UnpackShape(InferenceContext* c) {
  std::vector<::tensorflow::PartialTensorShape> shapes;
  TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
  if (static_cast<int>(shapes.size()) != c->num_outputs()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PoseidonUnpack: shapes has ", shapes.size(), " entries but out_types has ",
        c->num_outputs()));
  }
  int64_t total = 0;
  for (int i = 0; i < c->num_outputs(); ++i) {
    if (!shapes[i].IsFullyDefined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PoseidonUnpack: shapes[", i, "] must be fully defined, got ", shapes[i].DebugString()));
    }
    ShapeHandle out;
    TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &out));
    c->set_output(i, out);
    total += shapes[i].num_elements();
  }
  ShapeHandle packed;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &packed));
  DimensionHandle unused;
  if (!c->Merge(c->Dim(packed, 0), c->MakeDim(total), &unused).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PoseidonUnpack: packed must have shape [", total,
        "] (the sum of the output sizes), got ", c->DebugString(packed)));
  }
  return ScalarScale(c, 1);
}

// chunks [P, n] -> sum [n].
Status SumChunksShape(InferenceContext* c) {
  ShapeHandle chunks;
  if (!c->WithRank(c->input(0), 2, &chunks).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PoseidonSumChunks: chunks must have shape [P, n], got ", c->DebugString(c->input(0))));
  }
  c->set_output(0, c->Vector(c->Dim(chunks, 1)));
  return ScalarScale(c, 1);
}

// u [R, M], v [R, N] -> grad [M, N].
Status SfbReconstructShape(InferenceContext* c) {
  ShapeHandle u;
  ShapeHandle v;
  DimensionHandle rows;
  if (!c->WithRank(c->input(0), 2, &u).ok() || !c->WithRank(c->input(1), 2, &v).ok() ||
      !c->Merge(c->Dim(u, 0), c->Dim(v, 0), &rows).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PoseidonSfbReconstruct: u must have shape [R, M] and v shape [R, N] with the same R, "
        "got u ",
        c->DebugString(c->input(0)), " and v ", c->DebugString(c->input(1))));
  }
  c->set_output(0, c->Matrix(c->Dim(u, 1), c->Dim(v, 1)));
  return ScalarScale(c, 2);
}

}  // namespace

REGISTER_OP("PoseidonPack")
    .Input("tensors: T")
    .Input("scale: float")
    .Output("packed: wire_dtype")
    .Attr("T: list({float, half, bfloat16}) >= 0")
    .Attr("wire_dtype: {float, half, bfloat16}")
    .SetShapeFn(PackShape)
    .Doc(R"doc(
Flattens and concatenates `tensors` into one 1-D buffer of `wire_dtype`, each element computed as
wire_dtype(float32(x) * scale) (round to nearest even) in one pass.
)doc");

REGISTER_OP("PoseidonUnpack")
    .Input("packed: wire_dtype")
    .Input("unscale: float")
    .Output("tensors: out_types")
    .Attr("wire_dtype: {float, half, bfloat16}")
    .Attr("out_types: list({float, half, bfloat16}) >= 0")
    .Attr("shapes: list(shape) >= 0")
    .SetShapeFn(UnpackShape)
    .Doc(R"doc(
Inverse of PoseidonPack: splits `packed` into tensors of `shapes` and `out_types`, each element
computed as out_type(float32(x) * unscale) in one pass.
)doc");

REGISTER_OP("PoseidonSumChunks")
    .Input("chunks: wire_dtype")
    .Input("scale: float")
    .Output("sum: out_dtype")
    .Attr("wire_dtype: {float, half, bfloat16}")
    .Attr("out_dtype: {float, half, bfloat16} = DT_FLOAT")
    .SetShapeFn(SumChunksShape)
    .Doc(R"doc(
sum[j] = out_dtype(float32(sum_p float32(chunks[p, j])) * scale), accumulated in float32 in
order p = 0, 1, ..., P-1: the local step of a reduce-scatter.
)doc");

REGISTER_OP("PoseidonSfbReconstruct")
    .Input("u: T")
    .Input("v: T")
    .Input("scale: float")
    .Output("grad: float")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(SfbReconstructShape)
    .Doc(R"doc(
grad = scale * u^T v in float32: the sufficient-factor reconstruction of a dense layer's
weight gradient from the stacked factors u [R, M] and v [R, N].
)doc");

}  // namespace poseidon
