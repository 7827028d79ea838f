// The fused CUDA Adam and gradient statistics against the double reference and the overflow flag.
// Builds whenever CUDA does; skips, saying so, where no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/adam.hpp"
#include "optim/compact_math.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/adam_reference.hpp"
#include "runtime/host/half.hpp"

namespace zest::kernels {
namespace {

bool gpu_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU visible: the fused Adam kernels are not run"

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T) + 16), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// Several tensors (more than one launch holds, with odd sizes and one spanning several chunks),
// bf16 gradients and bf16 output, 300 steps: within bounds of the double reference (nvcc contracts
// into FMAs, so the GPU is not bit-identical to the CPU), and the output exactly bf16(master).
TEST(CudaAdam, MultiTensorTracksDoubleReference) {
  SKIP_WITHOUT_GPU();
  const optim::AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 30; ++i) sizes.push_back(1 + 37 * static_cast<std::size_t>(i));
  sizes.push_back(3 * 65536 + 5);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Host {
    std::vector<float> init;
    optim::test::ReferenceAdam ref;
  };
  std::vector<Host> hosts;
  std::vector<CudaAdamTensor> tensors;
  for (std::size_t n : sizes) {
    std::vector<float> init(n);
    for (auto& x : init) x = normal(rng);
    hosts.push_back({init, optim::test::ReferenceAdam(hp, init)});
    CudaAdamTensor t;
    t.master = to_device(init);
    t.m = to_device(std::vector<float>(n, 0.0f));
    t.v = to_device(std::vector<float>(n, 0.0f));
    t.out = to_device(std::vector<std::uint16_t>(n, 0));
    t.count = static_cast<std::int64_t>(n);
    tensors.push_back(t);
  }
  for (int step = 1; step <= 300; ++step) {
    std::vector<void*> grads;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      std::vector<std::uint16_t> g(sizes[k]);
      std::vector<float> widened(sizes[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        g[i] = float_to_bf16(normal(rng));
        widened[i] = bf16_to_float(g[i]);
      }
      hosts[k].ref.step(widened, step, 0.5, 1.0);
      tensors[k].grad = to_device(g);
      grads.push_back(const_cast<void*>(tensors[k].grad));
    }
    launch_multi_tensor_adam(tensors, DType::bf16, true, DType::bf16,
                             optim::make_adam_coefficients(hp, step, 0.5, 1.0), nullptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (void* g : grads) cudaFree(g);
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::vector<float> p = to_host(tensors[k].master, sizes[k]);
    const std::vector<std::uint16_t> out = to_host(static_cast<std::uint16_t*>(tensors[k].out), sizes[k]);
    EXPECT_LE(optim::test::worst_ratio(p.data(), hosts[k].ref.p, 300 * 2 * std::ldexp(1.0, -24), 300 * 1e-3 * 1e-5),
              1.0)
        << k;
    for (std::size_t i = 0; i < sizes[k]; ++i) ASSERT_EQ(out[i], float_to_bf16(p[i])) << k << ":" << i;
  }
  for (const CudaAdamTensor& t : tensors) {
    cudaFree(t.master);
    cudaFree(t.m);
    cudaFree(t.v);
    cudaFree(t.out);
  }
}

// An Inf gradient sets the flag; the Adam launched after it leaves every tensor as it was.
TEST(CudaAdam, OverflowFlagSkipsTheStep) {
  SKIP_WITHOUT_GPU();
  const std::size_t n = 1000;
  std::vector<float> init(n, 1.0f), grad(n, 0.5f);
  grad[777] = INFINITY;
  float* p = to_device(init);
  float* m = to_device(std::vector<float>(n, 0.0f));
  float* v = to_device(std::vector<float>(n, 0.0f));
  float* g = to_device(grad);
  double* sum = to_device(std::vector<double>(1, 0.0));
  int* overflow = to_device(std::vector<int>(1, 0));
  const CudaGradTensor gt{g, static_cast<std::int64_t>(n)};
  launch_grad_stats({&gt, 1}, DType::f32, sum, overflow, nullptr);
  const CudaAdamTensor t{p, m, v, g, nullptr, static_cast<std::int64_t>(n)};
  launch_multi_tensor_adam({&t, 1}, DType::f32, false, DType::bf16, optim::make_adam_coefficients({}, 1),
                           overflow, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host(overflow, 1)[0], 1);
  EXPECT_EQ(to_host(p, n), init);
  // Without the Inf the flag stays clear, the sum of squares is exact, and the step happens.
  grad[777] = 0.5f;
  ASSERT_EQ(cudaMemcpy(g, grad.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(overflow, 0, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(sum, 0, sizeof(double)), cudaSuccess);
  launch_grad_stats({&gt, 1}, DType::f32, sum, overflow, nullptr);
  launch_multi_tensor_adam({&t, 1}, DType::f32, false, DType::bf16, optim::make_adam_coefficients({}, 1),
                           overflow, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host(overflow, 1)[0], 0);
  EXPECT_DOUBLE_EQ(to_host(sum, 1)[0], 0.25 * n);
  EXPECT_NE(to_host(p, n), init);
  for (void* d : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v), static_cast<void*>(g),
                  static_cast<void*>(sum), static_cast<void*>(overflow)})
    cudaFree(d);
}

// Compact states on the GPU equal the CPU Adam's (CpuAdam::step_compact) bit for bit: master, m,
// v, int8's scales and the bf16 copy, for bf16 and int8 states with fp32 and bf16 gradients, over
// tensors of odd sizes (int8: short last blocks; one tensor over several chunks) and 20 steps.
TEST(CudaAdam, CompactStatesEqualTheCpuAdamBitForBit) {
  SKIP_WITHOUT_GPU();
  const optim::AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const std::vector<std::size_t> sizes = {1, 63, 64, 65, 1000, 2 * 65536 + 100};
  constexpr std::uint64_t kSeed = 7;
  for (const StatesFormat format : {StatesFormat::bf16, StatesFormat::int8}) {
    for (const DType grad_dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(states_format_name(format)) + " states, " + std::string(dtype_name(grad_dtype)) +
                   " gradients");
      const std::size_t state_size = format == StatesFormat::bf16 ? 2 : 1;
      std::mt19937 rng(11);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      struct Host {
        std::vector<float> master;
        std::vector<unsigned char> m, v;
        std::vector<float> m_scale, v_scale;
        std::vector<std::uint16_t> out;
      };
      std::vector<Host> hosts;
      std::vector<CudaCompactAdamTensor> tensors;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t n = sizes[k], blocks = (n + optim::kInt8Block - 1) / optim::kInt8Block;
        Host h;
        for (std::size_t i = 0; i < n; ++i) h.master.push_back(normal(rng));
        h.m.assign(n * state_size, 0);
        h.v.assign(n * state_size, 0);
        h.m_scale.assign(blocks, 0.0f);
        h.v_scale.assign(blocks, 0.0f);
        h.out.assign(n, 0);
        CudaCompactAdamTensor t;
        t.master = to_device(h.master);
        t.m = to_device(h.m);
        t.v = to_device(h.v);
        t.m_scale = to_device(h.m_scale);
        t.v_scale = to_device(h.v_scale);
        t.out = to_device(h.out);
        t.count = static_cast<std::int64_t>(n);
        t.first_index = (std::uint64_t{1} << 33) * k + 12345;  // the high word matters too
        tensors.push_back(t);
        hosts.push_back(std::move(h));
      }
      optim::CpuAdam cpu(hp, 1);
      for (int step = 1; step <= 20; ++step) {
        std::vector<void*> grads;
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          const std::size_t n = sizes[k];
          std::vector<float> g(n);
          std::vector<std::uint16_t> g16(n);
          for (std::size_t i = 0; i < n; ++i) {
            g16[i] = float_to_bf16(normal(rng) * (i % 7 == 0 ? 100.0f : 1.0f));  // outliers in the blocks
            g[i] = bf16_to_float(g16[i]);
          }
          Host& h = hosts[k];
          const optim::CpuAdam::CompactStates states{format, h.m.data(), h.v.data(), n, h.m_scale.data(),
                                                     h.v_scale.data()};
          const optim::ConstTensorSpan grad{grad_dtype == DType::f32 ? static_cast<const void*>(g.data()) : g16.data(),
                                            grad_dtype, n};
          cpu.step_compact(h.master, states, grad, {step, 0.5, 1.0}, {kSeed, tensors[k].first_index},
                           {h.out.data(), DType::bf16, n});
          tensors[k].grad = grad_dtype == DType::f32 ? static_cast<const void*>(to_device(g)) : to_device(g16);
          grads.push_back(const_cast<void*>(tensors[k].grad));
        }
        launch_multi_tensor_adam_compact(tensors, format, grad_dtype, true, DType::bf16,
                                         optim::make_adam_coefficients(hp, step, 0.5, 1.0),
                                         optim::rounding_key(kSeed, step), nullptr, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (void* g : grads) cudaFree(g);
      }
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const Host& h = hosts[k];
        const CudaCompactAdamTensor& t = tensors[k];
        const std::size_t n = sizes[k];
        EXPECT_EQ(to_host(t.master, n), h.master) << "tensor " << k;
        EXPECT_EQ(to_host(static_cast<unsigned char*>(t.m), n * state_size), h.m) << "tensor " << k;
        EXPECT_EQ(to_host(static_cast<unsigned char*>(t.v), n * state_size), h.v) << "tensor " << k;
        EXPECT_EQ(to_host(static_cast<std::uint16_t*>(t.out), n), h.out) << "tensor " << k;
        if (format == StatesFormat::int8) {
          EXPECT_EQ(to_host(t.m_scale, h.m_scale.size()), h.m_scale) << "tensor " << k;
          EXPECT_EQ(to_host(t.v_scale, h.v_scale.size()), h.v_scale) << "tensor " << k;
        }
        for (void* d : {static_cast<void*>(t.master), t.m, t.v, static_cast<void*>(t.m_scale),
                        static_cast<void*>(t.v_scale), t.out})
          cudaFree(d);
      }
    }
  }
}

}  // namespace
}  // namespace zest::kernels
