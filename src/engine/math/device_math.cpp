#include "engine/math/device_math.hpp"

#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::engine {

void DeviceMath::quantize_pieces(const void* in, DType dtype, std::size_t piece, std::size_t in_pieces,
                                 std::span<const std::size_t> order, optim::QuantBits bits, void* out,
                                 Stream& stream) {
  const std::size_t record = optim::quantized_bytes(bits, piece), piece_bytes = piece * dtype_size(dtype);
  for (std::size_t r = 0; r < order.size(); ++r) {
    if (order[r] >= in_pieces)
      throw Error(
          fmt::format("DeviceMath::quantize_pieces: record {} takes piece {} of {}; pass piece indices below that", r,
                      order[r], in_pieces));
    quantize(static_cast<const char*>(in) + order[r] * piece_bytes, dtype, piece, bits,
             static_cast<char*>(out) + r * record, stream);
  }
}

void DeviceMath::dequantize_sum(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t sums,
                                std::size_t terms, float* out, Stream& stream) {
  const std::size_t record = optim::quantized_bytes(bits, piece);
  for (std::size_t t = 0; t < terms; ++t)
    for (std::size_t s = 0; s < sums; ++s) {
      const char* const codes = static_cast<const char*>(in) + (t * sums + s) * record;
      if (t == 0) dequantize(codes, bits, piece, out + s * piece, DType::f32, stream);
      else dequantize_add(codes, bits, piece, out + s * piece, stream);
    }
}

void DeviceMath::dequantize_pieces(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t pieces,
                                   void* out, DType dtype, Stream& stream) {
  const std::size_t record = optim::quantized_bytes(bits, piece), piece_bytes = piece * dtype_size(dtype);
  for (std::size_t r = 0; r < pieces; ++r)
    dequantize(static_cast<const char*>(in) + r * record, bits, piece, static_cast<char*>(out) + r * piece_bytes,
               dtype, stream);
}

std::unique_ptr<DeviceMath> make_device_math(Device& device, const optim::AdamHyperParams& hyper,
                                             int threads, std::size_t max_spans) {
  switch (device.type()) {
    case DeviceType::cpu: return make_cpu_device_math(hyper, threads, device.host_cpus());
    case DeviceType::cuda: return make_cuda_device_math(device, hyper, max_spans);
  }
  return make_cpu_device_math(hyper, threads, device.host_cpus());  // unreachable: every DeviceType is handled above
}

}  // namespace zest::engine
