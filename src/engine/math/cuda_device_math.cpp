// The engine's math on the cuda backend: the fused multi-tensor Adam (fp32 or compact states) and
// gradient statistics of kernels/adam.hpp, plus the accumulation and packing kernels, queued on the
// stream's CUDA stream. Each call packs its spans into a table reserved at construction (the
// kernels copy it into their launch parameters), so a step allocates nothing.
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "engine/math/device_math.hpp"
#include "kernels/accumulate.hpp"
#include "kernels/adam.hpp"
#include "kernels/block_quant.hpp"
#include "kernels/cast.hpp"
#include "kernels/grad_stats_pack.hpp"
#include "optim/compact_math.hpp"
#include "runtime/device/cuda_check.hpp"
#include "runtime/device/cuda_device.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

class CudaDeviceMath final : public DeviceMath {
 public:
  CudaDeviceMath(Device& device, const optim::AdamHyperParams& hyper, std::size_t max_spans)
      : ordinal_(cuda_device_ordinal(device)), hyper_(hyper), max_spans_(max_spans) {
    if (ordinal_ < 0)
      throw SystemError(std::string("the engine's CUDA math needs a cuda Device, got '")
                            .append(device.name()).append("'"));
    grad_table_.reserve(max_spans);
    adam_table_.reserve(max_spans);
    compact_table_.reserve(max_spans);
  }

  void accumulate(void* dst, const void* src, std::size_t count, DType dtype, bool first,
                  Stream& stream) override {
    const cudaStream_t s = handle(stream);
    if (first) {
      if (count > 0) ZEST_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * dtype_size(dtype), cudaMemcpyDeviceToDevice, s));
    } else {
      kernels::accumulate_async(dst, src, dtype, count, s);
    }
  }

  void grad_stats(std::span<const GradSpan> grads, DType dtype, GradStatsScalars* out,
                  Stream& stream) override {
    const cudaStream_t s = handle(stream);
    check_span_count(grads.size(), "grad_stats");
    grad_table_.clear();
    for (const GradSpan& g : grads)
      grad_table_.push_back(kernels::CudaGradTensor{g.data, static_cast<std::int64_t>(g.count)});
    // launch_grad_stats adds to what is there.
    ZEST_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(GradStatsScalars), s));
    kernels::launch_grad_stats(grad_table_, dtype, &out->sum_squares, &out->nonfinite, s);
    kernels::pack_grad_stats_async(&out->sum_squares, &out->nonfinite, out->reduced, s);
  }

  void adam_step(std::span<const AdamShard> shards, DType grad_dtype, DType out_dtype,
                 const optim::AdamStepArgs& args, Stream& stream) override {
    const cudaStream_t s = handle(stream);
    check_span_count(shards.size(), "adam_step");
    for (const AdamShard& a : shards)
      if (a.bf16_master != nullptr)
        throw Error("cuda Adam: a bf16 master (optimizer.master: bf16) has no CUDA kernel yet; use "
                    "optimizer.master: fp32 (bf16 or int8 optimizer.states stay compact on the GPU), or offload "
                    "the optimizer (offload.optimizer.device: cpu or nvme, ratio 1)");
    const bool low_precision = out_dtype != DType::f32;
    // One launch per run of shards sharing their optimizer parameter group's hyper-parameters and
    // the form of their states (and, compact, the rounding seed: one key per launch).
    const auto same_launch = [](const AdamShard& a, const AdamShard& b) {
      return a.hyper == b.hyper && a.compact.format == b.compact.format &&
             (a.compact.format == StatesFormat::f32 || a.rounding.seed == b.rounding.seed);
    };
    for (std::size_t first = 0; first < shards.size();) {
      const AdamShard& head = shards[first];
      std::size_t last = first + 1;
      while (last < shards.size() && same_launch(shards[last], head)) ++last;
      const optim::AdamCoefficients c =
          optim::make_adam_coefficients(head.hyper ? *head.hyper : hyper_, args.step, args.grad_scale, args.clip_coef);
      // The step was already skipped on the host when a gradient overflowed: no device flag.
      if (head.compact.format == StatesFormat::f32) {
        adam_table_.clear();
        for (std::size_t i = first; i < last; ++i) {
          const AdamShard& a = shards[i];
          adam_table_.push_back(kernels::CudaAdamTensor{a.master, a.m, a.v, a.grad, low_precision ? a.out : nullptr,
                                                        static_cast<std::int64_t>(a.count)});
        }
        kernels::launch_multi_tensor_adam(adam_table_, grad_dtype, low_precision, out_dtype, c, nullptr, s);
      } else {
        compact_table_.clear();
        for (std::size_t i = first; i < last; ++i) {
          const AdamShard& a = shards[i];
          compact_table_.push_back(kernels::CudaCompactAdamTensor{
              a.master, a.compact.m, a.compact.v, a.compact.m_scale, a.compact.v_scale, a.grad,
              low_precision ? a.out : nullptr, static_cast<std::int64_t>(a.count), a.rounding.first_index});
        }
        kernels::launch_multi_tensor_adam_compact(compact_table_, head.compact.format, grad_dtype, low_precision,
                                                  out_dtype, c, optim::rounding_key(head.rounding.seed, args.step),
                                                  nullptr, s);
      }
      first = last;
    }
    if (!low_precision) {
      // fp32 parameters apart from the master weights: copy them where the trainer reads them (none
      // where the master is the parameters: out is null).
      for (const AdamShard& a : shards)
        if (a.count > 0 && a.out != nullptr)
          ZEST_CUDA_CHECK(cudaMemcpyAsync(a.out, a.master, a.count * sizeof(float), cudaMemcpyDeviceToDevice, s));
    }
  }

  void quantize(const void* in, DType dtype, std::size_t count, optim::QuantBits bits, void* out,
                Stream& stream) override {
    kernels::quantize_async(in, dtype, count, bits, out, handle(stream));
  }

  void dequantize(const void* in, optim::QuantBits bits, std::size_t count, void* out, DType dtype,
                  Stream& stream) override {
    kernels::dequantize_async(in, bits, count, out, dtype, handle(stream));
  }

  void dequantize_add(const void* in, optim::QuantBits bits, std::size_t count, float* acc,
                      Stream& stream) override {
    kernels::dequantize_add_async(in, bits, count, acc, handle(stream));
  }

  void cast_from_f32(const float* in, std::size_t count, void* out, DType dtype, Stream& stream) override {
    kernels::cast_async(in, DType::f32, out, dtype, count, handle(stream));
  }

 private:
  // Kernels launch on the calling thread's current device, which must be the stream's.
  cudaStream_t handle(Stream& stream) const {
    ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
    return cuda_stream_handle(stream);
  }

  void check_span_count(std::size_t count, const char* operation) const {
    if (count > max_spans_)
      throw Error(fmt::format(
          "DeviceMath::{}: {} spans, but the math was made for at most {}; pass a larger max_spans to make_device_math",
          operation, count, max_spans_));
  }

  int ordinal_;
  optim::AdamHyperParams hyper_;
  std::size_t max_spans_;
  std::vector<kernels::CudaGradTensor> grad_table_;
  std::vector<kernels::CudaAdamTensor> adam_table_;
  std::vector<kernels::CudaCompactAdamTensor> compact_table_;
};

}  // namespace

std::unique_ptr<DeviceMath> make_cuda_device_math(Device& device, const optim::AdamHyperParams& hyper,
                                                  std::size_t max_spans) {
  return std::make_unique<CudaDeviceMath>(device, hyper, max_spans);
}

}  // namespace zest::engine
