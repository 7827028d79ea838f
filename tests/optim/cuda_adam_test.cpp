// The fused CUDA Adam and gradient statistics against the double reference and the overflow flag.
// Builds whenever CUDA does; skips, saying so, where no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/adam.hpp"
#include "optim/adam_reference.hpp"
#include "runtime/half.hpp"

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
    EXPECT_LE(optim::test::worst_ratio(p.data(), hosts[k].ref.p, 300 * 2 * std::ldexp(1.0, -24), 300 * 1e-3 * 1e-5), 1.0) << k;
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

}  // namespace
}  // namespace zest::kernels
