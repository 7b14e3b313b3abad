// Standalone check of the tf_poseidon CUDA kernels, no TensorFlow needed: runs every launcher of
// poseidon_cuda.h on random data against a CPU reference (convert.h on the host), then times them
// at realistic sizes. Exit status 0 iff every check passed. ci/check_cuda_on_gpu.sh builds and runs
// it:
//
//   nvcc -std=c++17 -O3 -Ikernels kernels/cuda_harness.cu kernels/poseidon_cuda.cu -o harness
//   ./harness
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "convert.h"
#include "poseidon_cuda.h"

namespace {

using poseidon::BF16;
using poseidon::ConvertJob;
using poseidon::Dtype;
using poseidon::F16;
using poseidon::F32;
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

// Host bytes of n elements of `dtype` with random signs and magnitudes 1e-8 .. 3e4, a NaN and
// an Inf among them when n > 2.
std::vector<uint8_t> RandomElements(Dtype dtype, int64_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> exponent(-8.0f, 4.5f);
  std::vector<uint8_t> bytes(n * ElementSize(dtype));
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* out = reinterpret_cast<typename T::Storage*>(bytes.data());
    for (int64_t i = 0; i < n; ++i) {
      const float magnitude = std::pow(10.0f, exponent(*rng));
      out[i] = T::FromFloat((*rng)() % 2 ? magnitude : -magnitude);
    }
    if (n > 2) {
      out[0] = T::FromFloat(NAN);
      out[1] = T::FromFloat(-INFINITY);
    }
  });
  return bytes;
}

// Element i of `bytes` as float.
float ValueAt(const std::vector<uint8_t>& bytes, Dtype dtype, int64_t i) {
  float value = 0.0f;
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    value = T::ToFloat(reinterpret_cast<const typename T::Storage*>(bytes.data())[i]);
  });
  return value;
}

// Equal, NaN matching NaN.
bool SameValue(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

struct DeviceBytes {
  explicit DeviceBytes(size_t size) : size(size) {
    CudaOrDie(cudaMalloc(&ptr, size == 0 ? 1 : size), "cudaMalloc");
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

// Packs tensors of the given sizes into one buffer and unpacks them again, as the ops do; 150
// tensors exercise the batching of jobs across launches.
void CheckConvert(Dtype tensor_type, Dtype wire_type, const std::vector<int64_t>& sizes,
                  std::mt19937* rng) {
  const float scale = 0.5f;
  std::vector<std::vector<uint8_t>> hosts;
  std::vector<DeviceBytes> tensors;
  std::vector<DeviceBytes> restored;
  int64_t total = 0;
  for (int64_t n : sizes) {
    hosts.push_back(RandomElements(tensor_type, n, rng));
    total += n;
  }
  for (const auto& host : hosts) {
    tensors.emplace_back(host);
    restored.emplace_back(host.size());
  }
  DeviceBytes packed(total * ElementSize(wire_type));
  std::vector<ConvertJob> pack_jobs;
  std::vector<ConvertJob> unpack_jobs;
  int64_t offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    char* at = static_cast<char*>(packed.ptr) + offset * ElementSize(wire_type);
    pack_jobs.push_back({tensors[t].ptr, at, sizes[t], tensor_type, wire_type});
    unpack_jobs.push_back({at, restored[t].ptr, sizes[t], wire_type, tensor_type});
    offset += sizes[t];
  }
  LaunchOrDie(poseidon::cuda::LaunchConvert(pack_jobs.data(), pack_jobs.size(), scale, nullptr),
              "LaunchConvert");
  LaunchOrDie(poseidon::cuda::LaunchConvert(unpack_jobs.data(), unpack_jobs.size(), 1 / scale,
                                            nullptr),
              "LaunchConvert");
  const std::vector<uint8_t> packed_host = packed.ToHost();
  bool ok = true;
  offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const std::vector<uint8_t> back = restored[t].ToHost();
    for (int64_t i = 0; i < sizes[t]; ++i) {
      float wire = 0.0f;
      float expected_back = 0.0f;
      VisitDtype(wire_type, [&](auto w) {
        VisitDtype(tensor_type, [&](auto x) {
          using W = decltype(w);
          using X = decltype(x);
          const float x_value = ValueAt(hosts[t], tensor_type, i);
          wire = W::ToFloat(W::FromFloat(x_value * scale));
          expected_back = X::ToFloat(X::FromFloat(wire * (1 / scale)));
        });
      });
      ok = ok && SameValue(ValueAt(packed_host, wire_type, offset + i), wire) &&
           SameValue(ValueAt(back, tensor_type, i), expected_back);
    }
    offset += sizes[t];
  }
  Check(ok, std::string("pack/unpack ") + Name(tensor_type) + " <-> " + Name(wire_type) + ", " +
                std::to_string(sizes.size()) + " tensors, " + std::to_string(total) + " elements");
}

void CheckSumChunks(Dtype wire_type, Dtype out_type, int64_t p, int64_t n, std::mt19937* rng) {
  const float scale = 0.25f;
  const std::vector<uint8_t> chunks = RandomElements(wire_type, p * n, rng);
  DeviceBytes chunks_device(chunks);
  DeviceBytes out(n * ElementSize(out_type));
  LaunchOrDie(poseidon::cuda::LaunchSumChunks(chunks_device.ptr, wire_type, p, n, scale, out.ptr,
                                              out_type, nullptr),
              "LaunchSumChunks");
  const std::vector<uint8_t> got = out.ToHost();
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0.0f;
    for (int64_t k = 0; k < p; ++k) acc += ValueAt(chunks, wire_type, k * n + j);
    float expected = 0.0f;
    VisitDtype(out_type, [&](auto o) {
      using O = decltype(o);
      expected = O::ToFloat(O::FromFloat(acc * scale));
    });
    ok = ok && SameValue(ValueAt(got, out_type, j), expected);
  }
  Check(ok, std::string("sum_chunks ") + Name(wire_type) + " -> " + Name(out_type) + ", P=" +
                std::to_string(p) + ", n=" + std::to_string(n));
}

void CheckSfb(Dtype dtype, int64_t r, int64_t m, int64_t n, std::mt19937* rng) {
  const float scale = 0.5f;
  std::normal_distribution<float> normal;
  std::vector<uint8_t> u(r * m * ElementSize(dtype));
  std::vector<uint8_t> v(r * n * ElementSize(dtype));
  VisitDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (auto* bytes : {&u, &v}) {
      auto* out = reinterpret_cast<typename T::Storage*>(bytes->data());
      for (size_t i = 0; i < bytes->size() / sizeof(*out); ++i) out[i] = T::FromFloat(normal(*rng));
    }
  });
  DeviceBytes u_device(u);
  DeviceBytes v_device(v);
  DeviceBytes out(m * n * sizeof(float));
  LaunchOrDie(poseidon::cuda::LaunchSfbReconstruct(u_device.ptr, v_device.ptr, dtype, r, m, n,
                                                   scale, static_cast<float*>(out.ptr), nullptr),
              "LaunchSfbReconstruct");
  const std::vector<uint8_t> got = out.ToHost();
  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double expected = 0.0;
      double magnitude = 0.0;
      for (int64_t k = 0; k < r; ++k) {
        const double term = static_cast<double>(ValueAt(u, dtype, k * m + i)) * scale *
                            ValueAt(v, dtype, k * n + j);
        expected += term;
        magnitude += std::fabs(term);
      }
      const double error = std::fabs(ValueAt(got, Dtype::kFloat32, i * n + j) - expected);
      worst = std::max(worst, error / (1e-6 * (1.0 + magnitude)));
    }
  }
  Check(worst <= 1.0, std::string("sfb_reconstruct ") + Name(dtype) + ", R=" + std::to_string(r) +
                          ", M=" + std::to_string(m) + ", N=" + std::to_string(n));
}

// Milliseconds per call of `launch` (best of 10, after a warm-up).
template <typename Launch>
float TimeMs(Launch launch) {
  cudaEvent_t start;
  cudaEvent_t stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  launch();
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  CudaOrDie(cudaGetLastError(), "timed launch");
  return best;
}

void TimeKernels() {
  const int64_t n = 25'000'000;  // 100 MB of float32
  DeviceBytes f32(n * 4);
  DeviceBytes f16(n * 2);
  cudaMemset(f32.ptr, 0, f32.size);
  const ConvertJob pack = {f32.ptr, f16.ptr, n, Dtype::kFloat32, Dtype::kFloat16};
  const float pack_ms =
      TimeMs([&] { LaunchOrDie(poseidon::cuda::LaunchConvert(&pack, 1, 0.5f, nullptr), "pack"); });
  const float copy_ms = TimeMs([&] {
    CudaOrDie(cudaMemcpyAsync(f16.ptr, f32.ptr, f16.size, cudaMemcpyDeviceToDevice), "copy");
  });
  std::printf("TIME pack 100 MB f32 -> f16: %.3f ms, %.0f GB/s (device memcpy %.0f GB/s)\n",
              pack_ms, n * 6 / pack_ms / 1e6, f16.size * 2 / copy_ms / 1e6);
  const int64_t p = 8;
  const int64_t chunk = n / p;
  const float sum_ms = TimeMs([&] {
    LaunchOrDie(poseidon::cuda::LaunchSumChunks(f16.ptr, Dtype::kFloat16, p, chunk, 1.0f, f32.ptr,
                                                Dtype::kFloat32, nullptr),
                "sum");
  });
  std::printf("TIME sum_chunks P=8, n=%lld f16 -> f32: %.3f ms, %.0f GB/s\n",
              static_cast<long long>(chunk), sum_ms, (p * chunk * 2 + chunk * 4) / sum_ms / 1e6);
  for (const auto& shape : {std::vector<int64_t>{64, 25088, 4096}, {64, 4096, 4096}}) {
    const int64_t r = shape[0], m = shape[1], cols = shape[2];
    DeviceBytes u(r * m * 4), v(r * cols * 4), out(m * cols * 4);
    cudaMemset(u.ptr, 0, u.size);
    cudaMemset(v.ptr, 0, v.size);
    const float ms = TimeMs([&] {
      LaunchOrDie(poseidon::cuda::LaunchSfbReconstruct(u.ptr, v.ptr, Dtype::kFloat32, r, m, cols,
                                                       1.0f, static_cast<float*>(out.ptr),
                                                       nullptr),
                  "sfb");
    });
    std::printf("TIME sfb_reconstruct f32 R=%lld M=%lld N=%lld: %.3f ms, %.0f GFLOP/s\n",
                static_cast<long long>(r), static_cast<long long>(m),
                static_cast<long long>(cols), ms, 2.0 * r * m * cols / ms / 1e6);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(20240531);
  const std::vector<int64_t> odd_sizes = {1, 7, 0, 1023, 100003};
  const std::vector<int64_t> many_sizes(150, 37);
  for (Dtype tensor_type : kDtypes) {
    for (Dtype wire_type : kDtypes) {
      CheckConvert(tensor_type, wire_type, odd_sizes, &rng);
      CheckSumChunks(wire_type, tensor_type, 3, 100003, &rng);
    }
  }
  CheckConvert(Dtype::kFloat32, Dtype::kFloat16, many_sizes, &rng);
  for (const auto& pn : {std::vector<int64_t>{0, 5}, {1, 1}, {8, 1023}}) {
    CheckSumChunks(Dtype::kFloat16, Dtype::kFloat32, pn[0], pn[1], &rng);
  }
  for (Dtype dtype : kDtypes) {
    for (const auto& shape : {std::vector<int64_t>{5, 7, 3}, {64, 129, 33}, {1, 1, 1}, {0, 4, 5},
                              {100, 70, 130}}) {
      CheckSfb(dtype, shape[0], shape[1], shape[2], &rng);
    }
  }
  TimeKernels();
  std::printf("%s: %d failure(s)\n", failures == 0 ? "OK" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
