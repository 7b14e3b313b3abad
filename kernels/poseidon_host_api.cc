// The CPU element loops as a plain C API on caller-owned buffers, for the communication engine
// thread and the numpy_function ops that hand it buckets (tf_poseidon/host_kernels.py calls it
// through ctypes). The engine packs, sums and unpacks buckets between MPI calls; going through
// TensorFlow ops there would cost a tensor allocation (page faults on every large buffer) and a
// copy per step, which measured as much as the conversion itself. Every function is
// single-threaded (it runs beside TensorFlow's own pools), never fails, and returns when done.
// Dtype codes: poseidon::Dtype.
#include <cstdint>

#include "cpu_loops.h"

#define POSEIDON_C_API extern "C" __attribute__((visibility("default")))

// dst[i] = dst_type(src_type(src[i]) * scale) for i in [0, n).
POSEIDON_C_API void poseidon_host_convert(const void* src, int32_t src_type, void* dst,
                                          int32_t dst_type, int64_t n, float scale) {
  const poseidon::ConvertJob job{src, dst, n, static_cast<poseidon::Dtype>(src_type),
                                 static_cast<poseidon::Dtype>(dst_type)};
  poseidon::RunJobPart(job, 0, n, scale);
}

// out[j] = out_type(scale * sum_p chunks[p * n + j]) for j in [0, n), accumulated in float32.
POSEIDON_C_API void poseidon_host_sum_chunks(const void* chunks, int32_t wire_type,
                                             int64_t num_chunks, int64_t n, float scale, void* out,
                                             int32_t out_type) {
  poseidon::SumChunksPart(static_cast<poseidon::Dtype>(wire_type),
                          static_cast<poseidon::Dtype>(out_type), chunks, num_chunks, n, 0, n,
                          scale, out);
}

// max |x[i]| over [0, n) as float32 bits (sign cleared): NaN if any element is NaN, else +Inf if
// any is infinite; 0 for n = 0.
POSEIDON_C_API uint32_t poseidon_host_max_abs_bits(const float* x, int64_t n) {
  return poseidon::MaxAbsBits(x, n);
}

// out[i] = (a[i] - b[i]) * scale for i in [0, n): one pass for SSP's share of an update.
POSEIDON_C_API void poseidon_host_scaled_difference(const float* __restrict a,
                                                    const float* __restrict b,
                                                    float* __restrict out, int64_t n,
                                                    float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = (a[i] - b[i]) * scale;
}

// out[i] = base[i] + sum_j (r[j][i] - scale * o[j][i]) for i in [0, n), j in [0, k), summed in
// order j = 0, 1, ... (base = nullptr counts as zeros): one pass over the inputs and the output
// for SSP's late updates (each result less the own contribution in it) added to the variables'
// values. out must not overlap r or o; it may be base. k >= 1.
POSEIDON_C_API void poseidon_host_sum_of_differences(const float* const* r, const float* const* o,
                                                     int32_t k, float scale, const float* base,
                                                     float* out, int64_t n) {
  // Tiles small enough that out's tile stays in L1 while the k pairs are added into it.
  constexpr int64_t kTile = 2048;
  for (int64_t start = 0; start < n; start += kTile) {
    const int64_t end = start + kTile < n ? start + kTile : n;
    const float* __restrict r0 = r[0];
    const float* __restrict o0 = o[0];
    if (base != nullptr) {
      for (int64_t i = start; i < end; ++i) out[i] = base[i] + (r0[i] - scale * o0[i]);
    } else {
      for (int64_t i = start; i < end; ++i) out[i] = r0[i] - scale * o0[i];
    }
    for (int32_t j = 1; j < k; ++j) {
      const float* __restrict rj = r[j];
      const float* __restrict oj = o[j];
      for (int64_t i = start; i < end; ++i) out[i] += rj[i] - scale * oj[i];
    }
  }
}
