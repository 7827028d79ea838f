// `zest bench adam --device cuda`: the fused Adam's throughput next to the GPU's copy bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/adam.hpp"
#include "cuda_adam_bench.hpp"
#include "runtime/device/cuda_check.hpp"

namespace zest::kernels {
namespace {

class DeviceArray {
 public:
  explicit DeviceArray(std::size_t bytes) {
    ZEST_CUDA_CHECK(cudaMalloc(&data_, bytes));
    ZEST_CUDA_CHECK(cudaMemset(data_, 0, bytes));
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
};

double median(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / 1e3;
}

}  // namespace

CudaAdamBenchResult bench_cuda_adam(std::size_t params, DType grad_dtype, bool has_out, DType out_dtype,
                                    int reps) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw SystemError("zest bench adam --device cuda: no GPU is visible; run on a GPU node or use --device cpu");
  ZEST_CUDA_CHECK(cudaSetDevice(0));
  DeviceArray p(params * 4), m(params * 4), v(params * 4), g(params * dtype_size(grad_dtype)),
      out(has_out ? params * 2 : 4);
  const CudaAdamTensor tensor{p.as<float>(), m.as<float>(), v.as<float>(), g.as<void>(),
                              has_out ? out.as<void>() : nullptr, static_cast<std::int64_t>(params)};
  cudaStream_t stream;
  ZEST_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  ZEST_CUDA_CHECK(cudaEventCreate(&start));
  ZEST_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> adam_ms, copy_ms;
  for (int r = 0; r <= reps; ++r) {  // pass 0 warms up
    const optim::AdamCoefficients c = optim::make_adam_coefficients({}, r + 1);
    float ms = 0;
    ZEST_CUDA_CHECK(cudaEventRecord(start, stream));
    launch_multi_tensor_adam({&tensor, 1}, grad_dtype, has_out, out_dtype, c, nullptr, stream);
    ZEST_CUDA_CHECK(cudaEventRecord(stop, stream));
    ZEST_CUDA_CHECK(cudaEventSynchronize(stop));
    ZEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (r > 0) adam_ms.push_back(ms);
    ZEST_CUDA_CHECK(cudaEventRecord(start, stream));
    ZEST_CUDA_CHECK(cudaMemcpyAsync(m.as<void>(), v.as<void>(), params * 4, cudaMemcpyDeviceToDevice, stream));
    ZEST_CUDA_CHECK(cudaEventRecord(stop, stream));
    ZEST_CUDA_CHECK(cudaEventSynchronize(stop));
    ZEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (r > 0) copy_ms.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return {static_cast<double>(params) / median(adam_ms), 2.0 * static_cast<double>(params) * 4 / median(copy_ms)};
}

}  // namespace zest::kernels
