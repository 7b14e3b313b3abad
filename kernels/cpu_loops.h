// Single-threaded element loops of the CPU kernels, shared by the TensorFlow op kernels
// (poseidon_kernels_cpu.cc, which splits them over TF's intra-op pool) and by the host C API
// (poseidon_host_api.cc, which the communication engine calls on its own buffers). The loops are
// written to auto-vectorise (see convert.h).
#ifndef TF_POSEIDON_KERNELS_CPU_LOOPS_H_
#define TF_POSEIDON_KERNELS_CPU_LOOPS_H_

#include <algorithm>
#include <cstdint>

#include "convert.h"

namespace poseidon {

template <typename In, typename Out>
void ConvertRange(const typename In::Storage* __restrict src, typename Out::Storage* __restrict dst,
                  int64_t size, float scale) {
  for (int64_t i = 0; i < size; ++i) dst[i] = ScaleConvert<In, Out>(src[i], scale);
}

// Elements [offset, offset + size) of one job.
inline void RunJobPart(const ConvertJob& job, int64_t offset, int64_t size, float scale) {
  VisitDtype(job.src_type, [&](auto in) {
    VisitDtype(job.dst_type, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      ConvertRange<In, Out>(static_cast<const typename In::Storage*>(job.src) + offset,
                            static_cast<typename Out::Storage*>(job.dst) + offset, size, scale);
    });
  });
}

// Sub-block of SumRange: an accumulator that stays in L1.
constexpr int64_t kSumBlock = 1024;

// out[j] = Out(scale * sum_p chunks[p * n + j]) for j in [begin, end), accumulated in float32;
// a NaN result is CanonicalNaN's.
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
    for (int64_t j = 0; j < size; ++j) {
      out[start + j] = Out::FromFloat(CanonicalNaN(acc[j] * scale));
    }
  }
}

// SumRange for runtime dtypes.
inline void SumChunksPart(Dtype wire_type, Dtype out_type, const void* chunks, int64_t num_chunks,
                          int64_t n, int64_t begin, int64_t end, float scale, void* out) {
  VisitDtype(wire_type, [&](auto wire) {
    VisitDtype(out_type, [&](auto out_tag) {
      using Wire = decltype(wire);
      using Out = decltype(out_tag);
      SumRange<Wire, Out>(static_cast<const typename Wire::Storage*>(chunks), num_chunks, n, begin,
                          end, scale, static_cast<typename Out::Storage*>(out));
    });
  });
}

// The largest |x[i]| as float32 bits with the sign cleared, compared as integers: every NaN
// orders above +Inf, which orders above every finite value, so a NaN or Inf anywhere shows.
inline uint32_t MaxAbsBits(const float* __restrict x, int64_t size) {
  uint32_t best = 0;
  for (int64_t i = 0; i < size; ++i) best = std::max(best, FloatToBits(x[i]) & 0x7FFFFFFFu);
  return best;
}

}  // namespace poseidon

#endif  // TF_POSEIDON_KERNELS_CPU_LOOPS_H_
