// The CUDA block quantizer (kernels/block_quant.hpp) against the CPU's (optim::BlockQuantizer, itself
// equal to the scalar reference): bit for bit, for each input and output type, both formats,
// counts that end blocks anywhere, and blocks with Inf and NaN. Builds whenever CUDA does; the
// kernels' tests skip, saying so, where no GPU is visible; the argument checks run everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/block_quant.hpp"
#include "optim/block_quant.hpp"
#include "optim/block_quant_reference.hpp"
#include "zest/error.hpp"

namespace zest::kernels {
namespace {

using optim::QuantBits;

bool gpu_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU visible: the block quantization kernels are not run"

// A device buffer of `bytes`, filled from `host` (when given) or with 0xa5 bytes.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n, const void* host = nullptr) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&ptr, n + 16), cudaSuccess);
    if (host != nullptr) {
      EXPECT_EQ(cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      EXPECT_EQ(cudaMemset(ptr, 0xa5, n + 16), cudaSuccess);
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<std::uint8_t> host() const {
    std::vector<std::uint8_t> out(bytes);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

std::vector<std::uint8_t> bytes_of(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  return {b, b + n};
}

TEST(CudaBlockQuant, EqualsTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  optim::BlockQuantizer cpu(2);
  for (QuantBits bits : {QuantBits::int8, QuantBits::int4}) {
    for (std::size_t count : optim::test::test_counts()) {
      std::vector<float> x = optim::test::mixed_values(count, 11 + static_cast<std::uint32_t>(count));
      if (count > 600) {
        x[300] = std::numeric_limits<float>::infinity();
        x[580] = std::numeric_limits<float>::quiet_NaN();
      }
      for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        const std::string at = "int" + std::to_string(static_cast<int>(bits)) + " " + std::string(dtype_name(dtype)) +
                               " count " + std::to_string(count);
        const optim::test::TypedValues in = optim::test::as_dtype(x, dtype);
        const std::size_t qbytes = optim::quantized_bytes(bits, count);
        std::vector<float> want_q(qbytes / 4);
        const std::span<std::byte> want_span(reinterpret_cast<std::byte*>(want_q.data()), qbytes);
        cpu.quantize({in.data(), dtype, count}, bits, want_span);

        const DeviceBuffer d_in(count * dtype_size(dtype), in.data());
        const DeviceBuffer d_q(qbytes);
        quantize_async(d_in.ptr, dtype, count, bits, d_q.ptr, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(d_q.host(), bytes_of(want_q.data(), qbytes)) << at;

        // Decoding (the CPU's buffer, now also the GPU's) to `dtype`, and adding to an fp32 sum.
        std::vector<float> want_out(count);
        cpu.dequantize(want_span, bits, {want_out.data(), dtype, count});
        const DeviceBuffer d_out(count * dtype_size(dtype));
        dequantize_async(d_q.ptr, bits, count, d_out.ptr, dtype, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(d_out.host(), bytes_of(want_out.data(), count * dtype_size(dtype))) << at;

        std::vector<float> acc = optim::test::mixed_values(count, 3);
        const DeviceBuffer d_acc(count * sizeof(float), acc.data());
        cpu.dequantize_add(want_span, bits, acc);
        dequantize_add_async(d_q.ptr, bits, count, static_cast<float*>(d_acc.ptr), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(d_acc.host(), bytes_of(acc.data(), count * sizeof(float))) << at;
      }
    }
  }
}

// The front end's checks come before anything touches the device, so they run without a GPU.
TEST(CudaBlockQuant, RefusesBadArgumentsBeforeLaunching) {
  alignas(16) static float buffer[64];
  auto* shifted = reinterpret_cast<unsigned char*>(buffer) + 2;
  const auto says = [](const std::function<void()>& call, const char* word) {
    try {
      call();
      ADD_FAILURE() << "no zest::Error; expected one saying " << word;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("kernels::"), std::string::npos) << e.what();
    }
  };
  says([&] { quantize_async(buffer, DType::f32, 16, QuantBits::int8, shifted, nullptr); }, "4-byte aligned");
  says([&] { quantize_async(shifted + 1, DType::f16, 16, QuantBits::int8, buffer, nullptr); }, "2-byte aligned");
  says([&] { quantize_async(buffer, DType::f32, 16, static_cast<QuantBits>(3), buffer + 32, nullptr); },
       "QuantBits::int8 or QuantBits::int4");
  says([&] { dequantize_async(buffer, QuantBits::int4, 16, buffer + 32, static_cast<DType>(5), nullptr); },
       "element type 5");
  says([&] { dequantize_add_async(buffer, QuantBits::int4, 16, buffer + 2, nullptr); }, "overlaps");
  says([&] { dequantize_add_async(nullptr, QuantBits::int8, 16, buffer, nullptr); }, "is null");
}

}  // namespace
}  // namespace zest::kernels
