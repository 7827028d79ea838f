// The arithmetic the engine does on device memory — adding micro-batch gradients, the gradient
// statistics, the Adam step — behind one small interface, so the engine itself never touches device
// memory and runs unchanged on every backend. cpu: host tasks on the stream's worker, running the
// CPU Adam; cuda: kernels on the stream's CUDA stream.
//
// Every call enqueues its work on `stream` and returns at once, so it is ordered with the
// communicator's collectives on the same stream; errors surface from Stream::synchronize(). All
// data pointers are device memory of the Device the math was made for. What they point at, and the
// span arrays passed in, must stay valid and unchanged until the stream has run the work.
// Threading: one host thread submits at a time (the Stream contract).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "optim/adam_math.hpp"
#include "optim/block_quant_math.hpp"
#include "optim/cpu_adam.hpp"
#include "zest/device.hpp"
#include "zest/dtype.hpp"

namespace zest::engine {

// `count` gradients in the call's dtype.
struct GradSpan {
  const void* data = nullptr;
  std::size_t count = 0;
};

// One contiguous run of a rank's shard: fp32 master weights and moments, updated in place, the
// gradient (in the call's grad dtype) and where the updated parameters go (in the call's out dtype).
// `hyper`: the shard's optimizer parameter group (null: the math's own, from make_device_math); it
// is read when the stream runs the step.
struct AdamShard {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  void* out = nullptr;
  std::size_t count = 0;
  const optim::AdamHyperParams* hyper = nullptr;
  // Compact states (optimizer.states bf16 or int8; m and v above unused): where they are and how
  // bf16's are rounded. Every backend gives the CPU Adam's bits (step_compact).
  optim::CpuAdam::CompactStates compact{StatesFormat::f32};
  optim::CpuAdam::CompactRounding rounding{};
  // optimizer.master bf16 (compact only; `master` unused). The cpu backend only: the CUDA kernels
  // keep an fp32 master, and the cuda backend refuses one.
  std::uint16_t* bf16_master = nullptr;
};

// The gradient statistics of one step, in device memory. `reduced` comes first so the ranks can
// all-reduce it in place (sum) as two floats; the rest is this rank's own result.
struct GradStatsScalars {
  float reduced[2];    // [sum of squares, or 0 when nonfinite; 1 when nonfinite, else 0]
  double sum_squares;  // this rank's, in double: exact where nothing is reduced; void if nonfinite
  int nonfinite;       // this rank's: 1 when some gradient is Inf or NaN
};

class DeviceMath {
 public:
  virtual ~DeviceMath() = default;

  // dst[i] = src[i] when `first`, else dst[i] += src[i], the sum formed in float and rounded once
  // to `dtype` (bit-identical on every backend). dst and src must not overlap.
  virtual void accumulate(void* dst, const void* src, std::size_t count, DType dtype, bool first,
                          Stream& stream) = 0;

  // Fills *out from all `grads` (as stored, before any scale). No spans: a zero sum, finite.
  virtual void grad_stats(std::span<const GradSpan> grads, DType dtype, GradStatsScalars* out,
                          Stream& stream) = 0;

  // One Adam/AdamW step over every shard (the math of optim/adam_math.hpp), then each shard's
  // updated master weights written to its `out` as `out_dtype` (fp32: a copy).
  virtual void adam_step(std::span<const AdamShard> shards, DType grad_dtype, DType out_dtype,
                         const optim::AdamStepArgs& args, Stream& stream) = 0;

  // The block quantizer of the quantized collectives (the format of optim/block_quant_math.hpp,
  // the same bits on every backend). Quantized buffers are optim::quantized_bytes(bits, count)
  // bytes, 4-byte aligned; no output overlaps its input.
  // out = the `count` elements at `in` (fp32, bf16 or fp16) quantized.
  virtual void quantize(const void* in, DType dtype, std::size_t count, optim::QuantBits bits, void* out,
                        Stream& stream) = 0;
  // out = the `count` elements quantized at `in`, decoded to `dtype`.
  virtual void dequantize(const void* in, optim::QuantBits bits, std::size_t count, void* out, DType dtype,
                          Stream& stream) = 0;
  // acc[i] += the value of element i quantized at `in`, in fp32.
  virtual void dequantize_add(const void* in, optim::QuantBits bits, std::size_t count, float* acc,
                              Stream& stream) = 0;
  // out[i] = in[i] rounded to `dtype` (nearest even; fp32: a copy).
  virtual void cast_from_f32(const float* in, std::size_t count, void* out, DType dtype, Stream& stream) = 0;

  // The pieces of a quantized collective, one call for all of them (the cpu backend: one task
  // whose tiles share one pass over its threads; the defaults here, which the cuda backend keeps:
  // the calls above, one per piece). The same bits either way. Records are
  // optim::quantized_bytes(bits, piece) bytes each, back to back.
  // Record r of `out` (order.size() records) = piece order[r] of `in`, which holds `in_pieces`
  // pieces back to back (every order[r] < in_pieces).
  virtual void quantize_pieces(const void* in, DType dtype, std::size_t piece, std::size_t in_pieces,
                               std::span<const std::size_t> order, optim::QuantBits bits, void* out, Stream& stream);
  // Piece s of `out` (`sums` fp32 pieces) = the sum of records t * sums + s of `in` over t < terms,
  // each decoded and added in t's order (a dequantize, then dequantize_adds).
  virtual void dequantize_sum(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t sums,
                              std::size_t terms, float* out, Stream& stream);
  // Piece r of `out` (`pieces` pieces of `dtype`) = record r of `in` decoded.
  virtual void dequantize_pieces(const void* in, optim::QuantBits bits, std::size_t piece, std::size_t pieces,
                                 void* out, DType dtype, Stream& stream);
};

// The math for `device`'s backend. `threads`: the CPU Adam's threads (cpu only; 0 = one per cpu of
// this rank, Device::host_cpus). `max_spans`: the most spans one call passes, so the calls
// themselves allocate nothing. Throws SystemError for a cuda device when zest was built without
// CUDA.
std::unique_ptr<DeviceMath> make_device_math(Device& device, const optim::AdamHyperParams& hyper,
                                             int threads, std::size_t max_spans);

// The backends, for make_device_math.
// `cpus`: where the CPU Adam runs (CpuAdam's: empty = every allowed cpu; the engine passes the
// rank's, Device::host_cpus).
std::unique_ptr<DeviceMath> make_cpu_device_math(const optim::AdamHyperParams& hyper, int threads,
                                                 std::vector<int> cpus = {});
std::unique_ptr<DeviceMath> make_cuda_device_math(Device& device, const optim::AdamHyperParams& hyper,
                                                  std::size_t max_spans);

}  // namespace zest::engine
