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
