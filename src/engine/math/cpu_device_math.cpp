// The engine's math on the cpu backend: device memory is host memory, so each call is a host task
// on the stream's worker — plain loops for accumulation, the CPU Adam (SIMD, on its own pinned
// threads) for the statistics and the step.
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "engine/math/device_math.hpp"
#include "optim/block_quant.hpp"
#include "runtime/host/half.hpp"

namespace zest::engine {
namespace {

void accumulate_now(void* dst, const void* src, std::size_t count, DType dtype, bool first) {
  if (first) {
    std::memcpy(dst, src, count * dtype_size(dtype));
  } else if (dtype == DType::f32) {
    float* d = static_cast<float*>(dst);
    const float* s = static_cast<const float*>(src);
    for (std::size_t i = 0; i < count; ++i) d[i] += s[i];
  } else {
    for (std::size_t i = 0; i < count; ++i)
      store_from_float(dst, dtype, i, load_as_float(dst, dtype, i) + load_as_float(src, dtype, i));
  }
}

// The engine submits all of its math to one stream, so the CPU Adam (one step at a time) is only
// ever used by that stream's worker.
class CpuDeviceMath final : public DeviceMath {
 public:
  CpuDeviceMath(const optim::AdamHyperParams& hyper, int threads, std::vector<int> cpus)
      : hyper_(hyper), adam_(hyper, threads, cpus), quantizer_(adam_.threads(), std::move(cpus)) {}

  void accumulate(void* dst, const void* src, std::size_t count, DType dtype, bool first,
                  Stream& stream) override {
    stream.host_task([=] { accumulate_now(dst, src, count, dtype, first); });
  }

  void grad_stats(std::span<const GradSpan> grads, DType dtype, GradStatsScalars* out,
                  Stream& stream) override {
    stream.host_task([this, grads, dtype, out] {
      double sum_squares = 0;
      bool nonfinite = false;
      for (const GradSpan& g : grads) {
        const optim::GradStats stats = adam_.grad_stats(optim::ConstTensorSpan{g.data, dtype, g.count});
        sum_squares += stats.sum_squares;
        nonfinite = nonfinite || stats.nonfinite;
      }
      out->reduced[0] = nonfinite ? 0.0f : static_cast<float>(sum_squares);
      out->reduced[1] = nonfinite ? 1.0f : 0.0f;
      out->sum_squares = sum_squares;
      out->nonfinite = nonfinite ? 1 : 0;
    });
  }

  void adam_step(std::span<const AdamShard> shards, DType grad_dtype, DType out_dtype,
                 const optim::AdamStepArgs& args, Stream& stream) override {
    stream.host_task([this, shards, grad_dtype, out_dtype, args] {
      for (const AdamShard& s : shards) {
        adam_.set_hyper(s.hyper ? *s.hyper : hyper_);
        std::span<float> master(s.master, s.count), m(s.m, s.count), v(s.v, s.count);
        const optim::ConstTensorSpan grad{s.grad, grad_dtype, s.count};
        // The kernel writes the parameters in its pass over the states (fp32 ones too, where they
        // are apart from the master; out is null where the master is the parameters).
        const optim::TensorSpan out{s.out, out_dtype, s.count};
        if (s.compact.format == StatesFormat::f32)
          adam_.step(master, m, v, grad, args, out);
        else if (s.bf16_master != nullptr)
          adam_.step_compact(std::span<std::uint16_t>(s.bf16_master, s.count), s.compact, grad, args, s.rounding, out);
        else
          adam_.step_compact(master, s.compact, grad, args, s.rounding, out);
      }
    });
  }

  void quantize(const void* in, DType dtype, std::size_t count, optim::QuantBits bits, void* out,
                Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.quantize(optim::ConstTensorSpan{in, dtype, count}, bits,
                          {static_cast<std::byte*>(out), optim::quantized_bytes(bits, count)});
    });
  }

  void dequantize(const void* in, optim::QuantBits bits, std::size_t count, void* out, DType dtype,
                  Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.dequantize({static_cast<const std::byte*>(in), optim::quantized_bytes(bits, count)}, bits,
                            optim::TensorSpan{out, dtype, count});
    });
  }

  void dequantize_add(const void* in, optim::QuantBits bits, std::size_t count, float* acc,
                      Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.dequantize_add({static_cast<const std::byte*>(in), optim::quantized_bytes(bits, count)}, bits,
                                {acc, count});
    });
  }

  void cast_from_f32(const float* in, std::size_t count, void* out, DType dtype, Stream& stream) override {
    stream.host_task([=, this] { quantizer_.cast_from_f32({in, count}, optim::TensorSpan{out, dtype, count}); });
  }

  void quantize_pieces(const void* in, DType dtype, std::size_t piece, std::size_t in_pieces,
                       std::span<const std::size_t> order, optim::QuantBits bits, void* out,
                       Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.quantize_pieces(optim::ConstTensorSpan{in, dtype, in_pieces * piece}, piece, order, bits,
                                 {static_cast<std::byte*>(out), order.size() * optim::quantized_bytes(bits, piece)});
    });
  }

  void dequantize_sum(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t sums, std::size_t terms,
                      float* out, Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.dequantize_sum(
          {static_cast<const std::byte*>(in), terms * sums * optim::quantized_bytes(bits, piece)}, bits, piece,
          terms, {out, sums * piece});
    });
  }

  void dequantize_pieces(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t pieces, void* out,
                         DType dtype, Stream& stream) override {
    stream.host_task([=, this] {
      quantizer_.dequantize_pieces({static_cast<const std::byte*>(in), pieces * optim::quantized_bytes(bits, piece)},
                                   bits, piece, optim::TensorSpan{out, dtype, pieces * piece});
    });
  }

 private:
  optim::AdamHyperParams hyper_;
  optim::CpuAdam adam_;
  // The collectives' codecs (quantized and 16-bit), on the CPU Adam's cpus (the two never run at once: one stream).
  optim::BlockQuantizer quantizer_;
};

}  // namespace

std::unique_ptr<DeviceMath> make_cpu_device_math(const optim::AdamHyperParams& hyper, int threads,
                                                 std::vector<int> cpus) {
  return std::make_unique<CpuDeviceMath>(hyper, threads, std::move(cpus));
}

}  // namespace zest::engine
