// Standalone check of the tf_poseidon CUDA kernels, no TensorFlow needed: runs every launcher of
// poseidon_cuda.h on fuzzed data (sizes 0, 1, odd and not multiples of the unroll width; NaN of
// both signs and with payloads, ±Inf, ±0, float32 and bfloat16 denormals, values beyond the
// float16 range) and on one tensor of more than 2^31 elements, and compares the bits with the CPU
// kernels' loops (cpu_loops.h) run on the host with TensorFlow's flush-to-zero/denormals-are-zero;
// then, where cuBLAS is available, checks the SFB GEMM mapping of sfb_gemm.h against a float64
// reference; then times pack/unpack against the device memcpy (goal: >= 50% of its bandwidth) and
// against ops.CompositeOps' kernel sequence (goal: >= 1.5x faster), and the SFB GEMM against
// CompositeOps' cast, multiply and GEMM (goal: <= 1.1x its time). Prints PASS/FAIL lines, then
// markdown table rows starting with "| harness |"; exit status 0 iff every check passed. Needs
// about 22 GB of GPU memory and 35 GB of host memory (the > 2^31-element case).
// ci/check_cuda_on_gpu.sh builds and runs it:
//
//   nvcc -std=c++17 -O3 -ftz=true -fmad=false -arch=native -Ikernels kernels/cuda_harness.cu \
//       kernels/poseidon_cuda.cu [-lcublas] -o harness && ./harness
#include <cuda_runtime.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "convert.h"
#include "cpu_loops.h"
#include "poseidon_cuda.h"
#include "sfb_gemm.h"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define POSEIDON_HARNESS_CUBLAS 1
#endif

namespace {

using poseidon::ConvertJob;
using poseidon::Dtype;
using poseidon::VisitDtype;

int failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

void CudaOrDie(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(2);
  }
}

void LaunchOrDie(const char* error, const char* what) {
  if (error != nullptr) {
    std::fprintf(stderr, "%s: %s\n", what, error);
    std::exit(2);
  }
}

const char* Name(Dtype dtype) {
  return dtype == Dtype::kFloat16 ? "f16" : dtype == Dtype::kBFloat16 ? "bf16" : "f32";
}

size_t ElementSize(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

// float32 bit patterns the kernels must get exactly right.
const uint32_t kSpecials[] = {
    0x7FC00000u, 0xFFC00000u, 0x7FC12345u, 0xFF800001u,  // NaNs: both signs, payloads, signalling
    0x7F800000u, 0xFF800000u, 0x00000000u, 0x80000000u,  // ±Inf, ±0
    0x00000001u, 0x807FFFFFu, 0x00400000u,               // float32 denormals
    0x477FE000u, 0xC77FF000u, 0x47800000u, 0x4B000000u,  // 65504, -65520, 65536, 2^23
    0x33800000u, 0xB3000000u, 0x387FC000u,               // float16 subnormal range
    0x00010000u, 0x80008000u,                            // bfloat16 denormals
};

// Host bytes of n elements of `dtype`: random signs and magnitudes 1e-8 .. 3e4, every 7th element
// one of kSpecials (rounded to `dtype`).
std::vector<uint8_t> FuzzElements(Dtype dtype, int64_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> exponent(-8.0f, 4.5f);
  std::vector<uint8_t> bytes(n * ElementSize(dtype));
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* out = reinterpret_cast<typename T::Storage*>(bytes.data());
    for (int64_t i = 0; i < n; ++i) {
      float value = std::pow(10.0f, exponent(*rng)) * ((*rng)() % 2 ? 1.0f : -1.0f);
      if ((*rng)() % 7 == 0) {
        uint32_t bits = kSpecials[(*rng)() % (sizeof(kSpecials) / sizeof(kSpecials[0]))];
        std::memcpy(&value, &bits, sizeof(value));
      }
      if (dtype == Dtype::kFloat32) {
        std::memcpy(out + i, &value, sizeof(value));
      } else {
        out[i] = T::FromFloat(value);
      }
    }
  });
  return bytes;
}

struct DeviceBytes {
  explicit DeviceBytes(size_t size) : size(size) {
    CudaOrDie(cudaMalloc(&ptr, size == 0 ? 1 : size), "cudaMalloc");
    CudaOrDie(cudaMemset(ptr, 0xA5, size == 0 ? 1 : size), "poison");
  }
  explicit DeviceBytes(const std::vector<uint8_t>& host) : DeviceBytes(host.size()) {
    CudaOrDie(cudaMemcpy(ptr, host.data(), size, cudaMemcpyHostToDevice), "copy to device");
  }
  DeviceBytes(DeviceBytes&& other) noexcept : ptr(other.ptr), size(other.size) {
    other.ptr = nullptr;
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(ptr); }
  std::vector<uint8_t> ToHost() const {
    std::vector<uint8_t> host(size);
    CudaOrDie(cudaMemcpy(host.data(), ptr, size, cudaMemcpyDeviceToHost), "copy to host");
    return host;
  }
  void* ptr = nullptr;
  size_t size;
};

const Dtype kDtypes[] = {Dtype::kFloat32, Dtype::kFloat16, Dtype::kBFloat16};

// Packs tensors of the given sizes into one buffer and unpacks them again, as the ops do, and
// compares both results' bits with the CPU loops'.
void CheckConvert(Dtype tensor_type, Dtype wire_type, const std::vector<int64_t>& sizes,
                  float scale, std::mt19937* rng) {
  std::vector<std::vector<uint8_t>> hosts;
  std::vector<DeviceBytes> tensors;
  std::vector<DeviceBytes> restored;
  int64_t total = 0;
  for (int64_t n : sizes) {
    hosts.push_back(FuzzElements(tensor_type, n, rng));
    total += n;
  }
  for (const auto& host : hosts) {
    tensors.emplace_back(host);
    restored.emplace_back(host.size());
  }
  DeviceBytes packed(total * ElementSize(wire_type));
  std::vector<uint8_t> expected_packed(packed.size);
  std::vector<ConvertJob> pack_jobs;
  std::vector<ConvertJob> unpack_jobs;
  int64_t offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const size_t at = offset * ElementSize(wire_type);
    pack_jobs.push_back({tensors[t].ptr, static_cast<char*>(packed.ptr) + at, sizes[t],
                         tensor_type, wire_type});
    unpack_jobs.push_back({static_cast<char*>(packed.ptr) + at, restored[t].ptr, sizes[t],
                           wire_type, tensor_type});
    poseidon::RunJobPart({hosts[t].data(), expected_packed.data() + at, sizes[t], tensor_type,
                          wire_type},
                         0, sizes[t], scale);
    offset += sizes[t];
  }
  LaunchOrDie(poseidon::cuda::LaunchConvert(pack_jobs.data(), pack_jobs.size(), scale, nullptr),
              "LaunchConvert");
  LaunchOrDie(poseidon::cuda::LaunchConvert(unpack_jobs.data(), unpack_jobs.size(), 1 / scale,
                                            nullptr),
              "LaunchConvert");
  bool ok = packed.ToHost() == expected_packed;
  offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    std::vector<uint8_t> expected_back(hosts[t].size());
    poseidon::RunJobPart({expected_packed.data() + offset * ElementSize(wire_type),
                          expected_back.data(), sizes[t], wire_type, tensor_type},
                         0, sizes[t], 1 / scale);
    ok = ok && restored[t].ToHost() == expected_back;
    offset += sizes[t];
  }
  Check(ok, std::string("pack/unpack ") + Name(tensor_type) + " <-> " + Name(wire_type) +
                ", scale " + std::to_string(scale) + ", " + std::to_string(sizes.size()) +
                " tensors, " + std::to_string(total) + " elements: bits equal the CPU loops'");
}

// Checks that `bytes` bytes of elements of `dtype` at `got` (from the GPU) equal `expected` (the
// CPU loops'); if not, also prints how many elements differ, how many of those are NaN on both
// sides, and the first difference's bits.
void CheckBits(const std::string& what, Dtype dtype, const void* got, const void* expected,
               size_t bytes) {
  const bool ok = std::memcmp(got, expected, bytes) == 0;
  Check(ok, what + ": bits equal the CPU loops'");
  if (ok) return;
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Storage = typename T::Storage;
    const auto* a = static_cast<const Storage*>(got);
    const auto* b = static_cast<const Storage*>(expected);
    int64_t differ = 0;
    int64_t both_nan = 0;
    int64_t first = -1;
    for (size_t i = 0; i < bytes / sizeof(Storage); ++i) {
      if (std::memcmp(a + i, b + i, sizeof(Storage)) == 0) continue;
      differ += 1;
      both_nan += std::isnan(T::ToFloat(a[i])) && std::isnan(T::ToFloat(b[i]));
      if (first < 0) first = static_cast<int64_t>(i);
    }
    uint32_t got_bits = 0;
    uint32_t expected_bits = 0;
    std::memcpy(&got_bits, a + first, sizeof(Storage));
    std::memcpy(&expected_bits, b + first, sizeof(Storage));
    std::printf("  %lld element(s) differ, %lld of them NaN on both sides; first at %lld: GPU "
                "0x%X, CPU 0x%X\n",
                static_cast<long long>(differ), static_cast<long long>(both_nan),
                static_cast<long long>(first), got_bits, expected_bits);
  });
}

void CheckSumChunks(Dtype wire_type, Dtype out_type, int64_t p, int64_t n, std::mt19937* rng) {
  const float scale = 0.25f;
  const std::vector<uint8_t> chunks = FuzzElements(wire_type, p * n, rng);
  DeviceBytes chunks_device(chunks);
  DeviceBytes out(n * ElementSize(out_type));
  LaunchOrDie(poseidon::cuda::LaunchSumChunks(chunks_device.ptr, wire_type, p, n, scale, out.ptr,
                                              out_type, nullptr),
              "LaunchSumChunks");
  std::vector<uint8_t> expected(out.size);
  poseidon::SumChunksPart(wire_type, out_type, chunks.data(), p, n, 0, n, scale, expected.data());
  CheckBits(std::string("sum_chunks ") + Name(wire_type) + " -> " + Name(out_type) + ", P=" +
                std::to_string(p) + ", n=" + std::to_string(n),
            out_type, out.ToHost().data(), expected.data(), out.size);
}

// fn(begin, end) over [0, n) split among the host's cores.
template <typename Fn>
void ParallelFor(int64_t n, Fn fn) {
  const int64_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      _mm_setcsr(_mm_getcsr() | 0x8040);  // each thread in TensorFlow's FTZ/DAZ mode
      fn(n * w / workers, n * (w + 1) / workers);
    });
  }
  for (auto& thread : threads) thread.join();
}

// One tensor of more than 2^31 elements (8.6 GB of float32, beyond any 32-bit element or byte
// index): pack f32 -> f16, unpack f16 -> f32, and sum_chunks over two halves of the packed
// buffer, each compared with the CPU loops bit for bit over every element.
void CheckLarge() {
  const int64_t n = (int64_t{1} << 31) + 5;
  std::vector<uint32_t> host(n);
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(begin);
    for (int64_t i = begin; i < end; ++i) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      // Random sign and mantissa, exponents 2^-24 .. 2^23: float16 subnormals, normals and
      // values beyond its range.
      const uint32_t bits = static_cast<uint32_t>(state);
      host[i] = (bits & 0x807FFFFFu) | ((103u + (bits >> 23) % 48u) << 23);
    }
  });
  DeviceBytes f32(n * 4);
  CudaOrDie(cudaMemcpy(f32.ptr, host.data(), f32.size, cudaMemcpyHostToDevice), "copy");
  DeviceBytes f16(n * 2);
  const ConvertJob pack{f32.ptr, f16.ptr, n, Dtype::kFloat32, Dtype::kFloat16};
  LaunchOrDie(poseidon::cuda::LaunchConvert(&pack, 1, 0.5f, nullptr), "large pack");
  std::vector<uint16_t> packed(n);
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    poseidon::RunJobPart({host.data(), packed.data(), n, Dtype::kFloat32, Dtype::kFloat16}, begin,
                         end - begin, 0.5f);
  });
  CheckBits("pack f32 -> f16 of 2^31 + 5 elements (8.6 GB)", Dtype::kFloat16,
            f16.ToHost().data(), packed.data(), n * 2);
  const ConvertJob unpack{f16.ptr, f32.ptr, n, Dtype::kFloat16, Dtype::kFloat32};
  LaunchOrDie(poseidon::cuda::LaunchConvert(&unpack, 1, 2.0f, nullptr), "large unpack");
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    poseidon::RunJobPart({packed.data(), host.data(), n, Dtype::kFloat16, Dtype::kFloat32}, begin,
                         end - begin, 2.0f);
  });
  CheckBits("unpack f16 -> f32 of 2^31 + 5 elements", Dtype::kFloat32, f32.ToHost().data(),
            host.data(), n * 4);
  const int64_t half = n / 2;
  LaunchOrDie(poseidon::cuda::LaunchSumChunks(f16.ptr, Dtype::kFloat16, 2, half, 0.5f, f32.ptr,
                                              Dtype::kFloat32, nullptr),
              "large sum_chunks");
  ParallelFor(half, [&](int64_t begin, int64_t end) {
    poseidon::SumChunksPart(Dtype::kFloat16, Dtype::kFloat32, packed.data(), 2, half, begin, end,
                            0.5f, host.data());
  });
  std::vector<float> summed(half);
  CudaOrDie(cudaMemcpy(summed.data(), f32.ptr, half * 4, cudaMemcpyDeviceToHost), "copy");
  CheckBits("sum_chunks P=2 of 2 x (2^30 + 2) f16 elements", Dtype::kFloat32, summed.data(),
            host.data(), half * 4);
}

// Milliseconds per call of `launch` (median of 20, after 3 warm-ups).
template <typename Launch>
float TimeMs(Launch launch) {
  cudaEvent_t start;
  cudaEvent_t stop;
  CudaOrDie(cudaEventCreate(&start), "event");
  CudaOrDie(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    CudaOrDie(cudaEventSynchronize(stop), "timed launch");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  CudaOrDie(cudaGetLastError(), "timed launch");
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

void Row(const std::string& what, float ms, const std::string& figure, const std::string& goal) {
  std::printf("| harness | %s | %.3f | %s | %s |\n", what.c_str(), ms, figure.c_str(),
              goal.c_str());
}

std::string Format(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

// pack f32 -> f16 and unpack f16 -> f32 of 400 MB of float32 in 50 tensors, against a device
// memcpy of the same bytes (bandwidth counts bytes read plus bytes written).
void TimeConvert() {
  const int64_t n = 100'000'000;
  const int tensors = 50;
  std::mt19937 rng(7);
  std::vector<float> host(n);
  std::normal_distribution<float> normal;
  for (auto& x : host) x = normal(rng);
  DeviceBytes f32(n * 4);
  DeviceBytes f16(n * 2);
  DeviceBytes copy(n * 4);
  CudaOrDie(cudaMemcpy(f32.ptr, host.data(), f32.size, cudaMemcpyHostToDevice), "copy");
  std::vector<ConvertJob> pack;
  std::vector<ConvertJob> unpack;
  for (int t = 0; t < tensors; ++t) {
    const int64_t begin = n * t / tensors;
    const int64_t size = n * (t + 1) / tensors - begin;
    pack.push_back({static_cast<float*>(f32.ptr) + begin, static_cast<uint16_t*>(f16.ptr) + begin,
                    size, Dtype::kFloat32, Dtype::kFloat16});
    unpack.push_back({static_cast<uint16_t*>(f16.ptr) + begin, static_cast<float*>(f32.ptr) + begin,
                      size, Dtype::kFloat16, Dtype::kFloat32});
  }
  const float copy_ms = TimeMs([&] {
    CudaOrDie(cudaMemcpyAsync(copy.ptr, f32.ptr, f32.size, cudaMemcpyDeviceToDevice), "copy");
  });
  const double copy_gbps = 2.0 * f32.size / copy_ms / 1e6;
  Row("device memcpy, 400 MB", copy_ms, Format("%.0f GB/s", copy_gbps), "");
  const float pack_ms = TimeMs([&] {
    LaunchOrDie(poseidon::cuda::LaunchConvert(pack.data(), tensors, 0.5f, nullptr), "pack");
  });
  const float unpack_ms = TimeMs([&] {
    LaunchOrDie(poseidon::cuda::LaunchConvert(unpack.data(), tensors, 2.0f, nullptr), "unpack");
  });
  for (const auto& [what, ms] : {std::pair<const char*, float>{"pack", pack_ms},
                                 std::pair<const char*, float>{"unpack", unpack_ms}}) {
    const double gbps = 6.0 * n / ms / 1e6;
    const double share = gbps / copy_gbps;
    Row(std::string(what) + " f32 <-> f16, 400 MB f32 in 50 tensors", ms,
        Format("%.0f GB/s", gbps) + Format(" (%.0f%% of memcpy)", 100 * share), ">= 50% of memcpy");
    Check(share >= 0.5, std::string(what) + " bandwidth " + Format("%.0f%%", 100 * share) +
                            " of device memcpy (goal >= 50%)");
  }
  // ops.CompositeOps as TensorFlow runs it on a GPU, kernel for kernel, the elementwise kernels
  // played by LaunchConvert (they move the same bytes): pack is, per tensor, a multiply by the
  // scale (f32 -> f32; the cast of a float32 tensor to float32 is no kernel) and its copy into
  // the concatenation, then one cast of the whole buffer to f16; unpack is one cast to f32 and
  // one multiply (tf.split along axis 0 shares the buffer: no copy). 36 bytes per element moved
  // against the compiled pair's 12.
  DeviceBytes scaled(n * 4);
  const float composite_ms = TimeMs([&] {
    for (int t = 0; t < tensors; ++t) {
      const ConvertJob& job = pack[t];
      const int64_t begin = static_cast<const float*>(job.src) - static_cast<float*>(f32.ptr);
      const ConvertJob multiply{job.src, static_cast<float*>(scaled.ptr) + begin, job.size,
                                Dtype::kFloat32, Dtype::kFloat32};
      LaunchOrDie(poseidon::cuda::LaunchConvert(&multiply, 1, 0.5f, nullptr), "multiply");
      CudaOrDie(cudaMemcpyAsync(static_cast<float*>(copy.ptr) + begin, multiply.dst, job.size * 4,
                                cudaMemcpyDeviceToDevice),
                "concat");
    }
    const ConvertJob cast{copy.ptr, f16.ptr, n, Dtype::kFloat32, Dtype::kFloat16};
    LaunchOrDie(poseidon::cuda::LaunchConvert(&cast, 1, 1.0f, nullptr), "cast");
    const ConvertJob widen{f16.ptr, scaled.ptr, n, Dtype::kFloat16, Dtype::kFloat32};
    LaunchOrDie(poseidon::cuda::LaunchConvert(&widen, 1, 1.0f, nullptr), "cast");
    const ConvertJob unscale{scaled.ptr, copy.ptr, n, Dtype::kFloat32, Dtype::kFloat32};
    LaunchOrDie(poseidon::cuda::LaunchConvert(&unscale, 1, 2.0f, nullptr), "multiply");
  });
  const double speedup = composite_ms / (pack_ms + unpack_ms);
  Row("CompositeOps' kernels, pack + unpack of the same", composite_ms,
      Format("compiled pair %.2fx faster", speedup), ">= 1.5x");
  Check(speedup >= 1.5, "pack + unpack " + Format("%.2fx", speedup) +
                            " faster than CompositeOps' kernel sequence (goal >= 1.5x)");
  const int64_t p = 8;
  const int64_t chunk = n / p;
  const float sum_ms = TimeMs([&] {
    LaunchOrDie(poseidon::cuda::LaunchSumChunks(f16.ptr, Dtype::kFloat16, p, chunk, 1.0f, f32.ptr,
                                                Dtype::kFloat32, nullptr),
                "sum");
  });
  Row("sum_chunks P=8 f16 -> f32, 200 MB in", sum_ms,
      Format("%.0f GB/s", (p * chunk * 2 + chunk * 4) / sum_ms / 1e6), "");
}

#ifdef POSEIDON_HARNESS_CUBLAS
void CublasOrDie(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(status));
    std::exit(2);
  }
}

cudaDataType CudaType(Dtype dtype) {
  return dtype == Dtype::kFloat16 ? CUDA_R_16F : dtype == Dtype::kBFloat16 ? CUDA_R_16BF
                                                                            : CUDA_R_32F;
}

// out = scale * u^T v through sfb_gemm.h's mapping, as the TF GPU kernel calls it.
void SfbGemm(cublasHandle_t handle, const void* u, const void* v, Dtype dtype, int64_t r, int64_t m,
             int64_t n, float scale, float* out, bool tf32) {
  const poseidon::SfbGemm g = poseidon::SfbGemm::For(r, m, n);
  const float beta = 0.0f;
  CublasOrDie(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, g.m, g.n, g.k, &scale, v,
                           CudaType(dtype), g.lda, u, CudaType(dtype), g.ldb, &beta, out,
                           CUDA_R_32F, g.ldc,
                           tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
}

void CheckSfb(cublasHandle_t handle, Dtype dtype, int64_t r, int64_t m, int64_t n,
              std::mt19937* rng) {
  const float scale = 0.5f;
  std::normal_distribution<float> normal;
  std::vector<uint8_t> u(r * m * ElementSize(dtype));
  std::vector<uint8_t> v(r * n * ElementSize(dtype));
  std::vector<float> u32(r * m);
  std::vector<float> v32(r * n);
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (auto [bytes, floats] : {std::pair{&u, &u32}, std::pair{&v, &v32}}) {
      auto* out = reinterpret_cast<typename T::Storage*>(bytes->data());
      for (size_t i = 0; i < floats->size(); ++i) {
        out[i] = T::FromFloat(normal(*rng));
        (*floats)[i] = T::ToFloat(out[i]);
      }
    }
  });
  DeviceBytes u_device(u);
  DeviceBytes v_device(v);
  DeviceBytes out(m * n * sizeof(float));
  if (r > 0) {
    SfbGemm(handle, u_device.ptr, v_device.ptr, dtype, r, m, n, scale,
            static_cast<float*>(out.ptr), false);
  } else {
    CudaOrDie(cudaMemset(out.ptr, 0, out.size), "zero");
  }
  std::vector<float> got(m * n);
  CudaOrDie(cudaMemcpy(got.data(), out.ptr, out.size, cudaMemcpyDeviceToHost), "copy");
  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double expected = 0.0;
      double magnitude = 0.0;
      for (int64_t k = 0; k < r; ++k) {
        const double term = static_cast<double>(u32[k * m + i]) * scale * v32[k * n + j];
        expected += term;
        magnitude += std::fabs(term);
      }
      worst = std::max(worst, std::fabs(got[i * n + j] - expected) / (1e-6 * (1.0 + magnitude)));
    }
  }
  Check(worst <= 1.0, std::string("sfb GEMM mapping ") + Name(dtype) + ", R=" +
                          std::to_string(r) + ", M=" + std::to_string(m) + ", N=" +
                          std::to_string(n) + ": within float32 rounding of float64");
}

void TimeSfb(cublasHandle_t handle) {
  for (const auto& shape : {std::vector<int64_t>{64, 25088, 4096}, {64, 4096, 4096}}) {
    const int64_t r = shape[0], m = shape[1], n = shape[2];
    for (const auto& variant : {std::pair{Dtype::kFloat32, false},
                                std::pair{Dtype::kFloat32, true},
                                std::pair{Dtype::kFloat16, false}}) {
      const Dtype dtype = variant.first;
      const bool tf32 = variant.second;
      std::mt19937 rng(11);
      DeviceBytes u(FuzzElements(dtype, r * m, &rng));
      DeviceBytes v(FuzzElements(dtype, r * n, &rng));
      DeviceBytes out(m * n * 4);
      const float ms = TimeMs([&] {
        SfbGemm(handle, u.ptr, v.ptr, dtype, r, m, n, 0.5f, static_cast<float*>(out.ptr), tf32);
      });
      // ops.CompositeOps.sfb_reconstruct's kernels: u and v cast to float32 (no kernel when
      // they are), u multiplied by the scale, then tf.matmul(u, v, transpose_a=True): the same
      // cuBLAS GEMM in float32, TF32 as TensorFlow's switch says (on by default).
      DeviceBytes u_cast(r * m * 4);
      DeviceBytes u32(r * m * 4);
      DeviceBytes v32(r * n * 4);
      const bool composite_tf32 = dtype == Dtype::kFloat32 ? tf32 : true;
      const float composite_ms = TimeMs([&] {
        const void* u_in = u.ptr;
        const void* v_in = v.ptr;
        if (dtype != Dtype::kFloat32) {
          const ConvertJob casts[] = {{u.ptr, u_cast.ptr, r * m, dtype, Dtype::kFloat32},
                                      {v.ptr, v32.ptr, r * n, dtype, Dtype::kFloat32}};
          for (const ConvertJob& cast : casts) {
            LaunchOrDie(poseidon::cuda::LaunchConvert(&cast, 1, 1.0f, nullptr), "cast");
          }
          u_in = u_cast.ptr;
          v_in = v32.ptr;
        }
        const ConvertJob multiply{u_in, u32.ptr, r * m, Dtype::kFloat32, Dtype::kFloat32};
        LaunchOrDie(poseidon::cuda::LaunchConvert(&multiply, 1, 0.5f, nullptr), "multiply");
        SfbGemm(handle, u32.ptr, v_in, Dtype::kFloat32, r, m, n, 1.0f,
                static_cast<float*>(out.ptr), composite_tf32);
      });
      const std::string shape_text = ", R=" + std::to_string(r) + " M=" + std::to_string(m) +
                                     " N=" + std::to_string(n);
      const double ratio = ms / composite_ms;
      Row(std::string("sfb GEMM (cuBLAS) ") + Name(dtype) + (tf32 ? " tf32" : "") + shape_text,
          ms, Format("%.1f TFLOP/s", 2.0 * r * m * n / ms / 1e9) +
                  Format(", %.2fx CompositeOps' time", ratio), "<= 1.1x");
      Check(ratio <= 1.1, std::string("sfb GEMM ") + Name(dtype) + (tf32 ? " tf32" : "") +
                              shape_text + Format(": %.2fx the time of CompositeOps' kernels",
                                                  ratio) + " (goal <= 1.1x)");
    }
  }
}
#endif  // POSEIDON_HARNESS_CUBLAS

}  // namespace

int main() {
  // The float32 environment of TensorFlow's CPU kernels, which the device code matches.
  _mm_setcsr(_mm_getcsr() | 0x8040);  // flush-to-zero | denormals-are-zero
  std::mt19937 rng(20240531);
  const std::vector<int64_t> odd_sizes = {1, 7, 0, 1023, 4097, 100003};
  const std::vector<int64_t> many_sizes(150, 37);
  for (Dtype tensor_type : kDtypes) {
    for (Dtype wire_type : kDtypes) {
      for (float scale : {1.0f, 0.5f, 1.0f / 3}) {
        CheckConvert(tensor_type, wire_type, odd_sizes, scale, &rng);
      }
      CheckSumChunks(wire_type, tensor_type, 3, 100003, &rng);
    }
  }
  CheckConvert(Dtype::kFloat32, Dtype::kFloat16, many_sizes, 0.5f, &rng);
  for (const auto& pn : {std::vector<int64_t>{0, 5}, {1, 1}, {8, 1023}, {5, 4097}}) {
    CheckSumChunks(Dtype::kFloat16, Dtype::kFloat32, pn[0], pn[1], &rng);
  }
#ifdef POSEIDON_HARNESS_CUBLAS
  cublasHandle_t handle;
  CublasOrDie(cublasCreate(&handle), "cublasCreate");
  for (Dtype dtype : kDtypes) {
    for (const auto& shape : {std::vector<int64_t>{5, 7, 3}, {64, 129, 33}, {1, 1, 1}, {0, 4, 5},
                              {100, 70, 130}}) {
      CheckSfb(handle, dtype, shape[0], shape[1], shape[2], &rng);
    }
  }
#else
  std::printf("SKIP sfb GEMM mapping: built without cuBLAS (no cublas_v2.h)\n");
#endif
  std::printf("| part | what | ms (median) | rate | goal |\n|---|---|---|---|---|\n");
  TimeConvert();
#ifdef POSEIDON_HARNESS_CUBLAS
  TimeSfb(handle);
  cublasDestroy(handle);
#endif
  CheckLarge();
  std::printf("%s: %d failure(s)\n", failures == 0 ? "OK" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
