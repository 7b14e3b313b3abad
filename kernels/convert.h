// Wire dtypes and the scaled element conversion shared by the CPU kernels, the CUDA kernels and
// the CUDA harness. No TensorFlow and no CUDA runtime dependency: this header compiles with g++
// and with nvcc (host and device code).
//
// Contract of every conversion: Out(In(x) * scale), computed in float32 and rounded to the output
// dtype with round-to-nearest-even; NaN stays NaN (quiet, same sign), ±Inf stays ±Inf, finite
// values beyond the float16 range become ±Inf only in a float16 output.
//
// Host and device run the very same integer and float32 operations (no CUDA conversion
// intrinsics: those turn every NaN into one canonical NaN, dropping its sign), so a GPU kernel
// gives the CPU kernel's bits. That also needs the same float32 environment on both sides:
// TensorFlow runs CPU kernels with flush-to-zero and denormals-are-zero, and kernels/build.py
// compiles the CUDA code with -ftz=true (and -fmad=false: no fused multiply-add, as
// -ffp-contract=off on the host).
#ifndef TF_POSEIDON_KERNELS_CONVERT_H_
#define TF_POSEIDON_KERNELS_CONVERT_H_

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define POSEIDON_HD __host__ __device__ __forceinline__
#else
#define POSEIDON_HD inline
#endif

namespace poseidon {

// The element types the ops accept (TF's DT_FLOAT, DT_HALF, DT_BFLOAT16).
enum class Dtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

POSEIDON_HD uint32_t FloatToBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

POSEIDON_HD float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Branch-free selection, so that host loops over elements auto-vectorise.
POSEIDON_HD uint32_t Select(bool condition, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

struct F32 {
  using Storage = float;
  static POSEIDON_HD float ToFloat(float x) { return x; }
  static POSEIDON_HD float FromFloat(float x) { return x; }
};

// IEEE binary16, with the float-arithmetic conversions of M. Dukhan's FP16 library (checked
// bit-exact against F16C for all 2^32 float inputs, NaN payloads aside); they stay correct with
// flush-to-zero/denormals-are-zero set, as in TensorFlow's worker threads.
struct F16 {
  using Storage = uint16_t;

  static POSEIDON_HD float ToFloat(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t two_w = w + w;
    const float normal = BitsToFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = BitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t finite =
        Select(two_w < (1u << 27), FloatToBits(subnormal), FloatToBits(normal));
#ifdef __CUDA_ARCH__
    // A NaN keeps its payload, quieted, as the host's multiplication in `normal` gives it by
    // itself (a GPU's multiplication gives its one canonical NaN instead). Only the device pays
    // for the select: on the host it would keep the loops over elements from vectorising.
    const uint32_t nan = 0x7FC00000u | ((two_w >> 4) & 0x007FFFFFu);
    return BitsToFloat((w & 0x80000000u) | Select(two_w > 0xF8000000u, nan, finite));
#else
    return BitsToFloat((w & 0x80000000u) | finite);
#endif
  }

  static POSEIDON_HD uint16_t FromFloat(float f) {
    const uint32_t w = FloatToBits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t bias_bits = shl1_w & 0xFF000000u;
    const uint32_t bias = bias_bits < 0x71000000u ? 0x71000000u : bias_bits;
    const float magnitude = BitsToFloat(FloatToBits(f) & 0x7FFFFFFFu);
    const float rounded = BitsToFloat((bias >> 1) + 0x07800000u) +
                          (magnitude * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t bits = FloatToBits(rounded);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return static_cast<uint16_t>(((w & 0x80000000u) >> 16) |
                                 Select(shl1_w > 0xFF000000u, 0x7E00u, nonsign));
  }
};

// bfloat16: the upper half of a float32, rounded to nearest even.
struct BF16 {
  using Storage = uint16_t;

  static POSEIDON_HD float ToFloat(uint16_t b) {
    return BitsToFloat(static_cast<uint32_t>(b) << 16);
  }

  static POSEIDON_HD uint16_t FromFloat(float f) {
    const uint32_t u = FloatToBits(f);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<uint16_t>(Select(is_nan, (u >> 16) | 0x40u, rounded));
  }
};

// Calls fn(F32{}), fn(F16{}) or fn(BF16{}) for a runtime dtype: one template body serves all.
// fn may be host-only or device-only (the pragma lets nvcc instantiate it for either side).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <typename Fn>
POSEIDON_HD void VisitDtype(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kFloat16:
      fn(F16{});
      break;
    case Dtype::kBFloat16:
      fn(BF16{});
      break;
    default:
      fn(F32{});
      break;
  }
}

// Whether float32 `bits` are a NaN (any sign, payload, quiet or signalling).
POSEIDON_HD bool IsNanBits(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }

// x, or the quiet NaN 0x7FC00000 when x is a NaN. Arithmetic that makes a NaN gives each device's
// own bits (x86 keeps the first NaN operand's payload and sign, and makes 0xFFC00000 of Inf - Inf;
// a GPU returns 0x7FFFFFFF), so a sum's NaN is replaced by this one on every device.
POSEIDON_HD float CanonicalNaN(float x) {
  const uint32_t bits = FloatToBits(x);
  return BitsToFloat(Select(IsNanBits(bits), 0x7FC00000u, bits));
}

// One element: Out(In(x) * scale), computed in float32. A NaN x stays that NaN, quieted (the
// host's multiplication does so; a GPU's returns one canonical, positive NaN), for any scale.
template <typename In, typename Out>
POSEIDON_HD typename Out::Storage ScaleConvert(typename In::Storage x, float scale) {
  const float value = In::ToFloat(x);
  const uint32_t bits = FloatToBits(value);
  const uint32_t product = FloatToBits(value * scale);
  return Out::FromFloat(BitsToFloat(Select(IsNanBits(bits), bits | 0x00400000u, product)));
}

// dst[i] = ScaleConvert(src[i], scale) for i in [0, size): the unit of work of pack and unpack.
struct ConvertJob {
  const void* src;
  void* dst;
  int64_t size;
  Dtype src_type;
  Dtype dst_type;
};

}  // namespace poseidon

#endif  // TF_POSEIDON_KERNELS_CONVERT_H_
