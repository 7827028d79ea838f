// The cpu backend's DeviceMath alone, on a cpu device's stream. What it proves:
// - accumulate copies on the first micro-batch and otherwise adds, the sum formed in float and
//   rounded once to the dtype, in fp32, bf16 and fp16;
// - grad_stats sums the squares of every span in double and reports a nonfinite gradient by the
//   flag, with the reduced pair (sum, flag) zeroed to (0, 1) so the ranks' sum says "nonfinite";
// - adam_step equals a double-precision AdamW and Adam written here, per shard with its own
//   hyper-parameters (or the math's own), writes fp32 parameters as the master weights and bf16 ones
//   as the master rounded to nearest even, with the loss scale and clip coefficient applied;
// - the pieces calls of the quantized collectives (one task for all pieces) give the bytes and bits
//   of DeviceMath's defaults, one quantize or dequantize per piece, which the cuda backend keeps.
#include "engine/math/device_math.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

constexpr std::size_t kCount = 37;  // not a multiple of any SIMD width

struct Rig {
  std::unique_ptr<Device> device = make_cpu_device(std::size_t{1} << 20);
  std::unique_ptr<Stream> stream = device->create_stream();
  std::unique_ptr<DeviceMath> math;
  explicit Rig(const optim::AdamHyperParams& hyper = {}) : math(make_cpu_device_math(hyper, 1)) {}
};

float value(std::size_t i, int salt) { return std::sin(static_cast<float>(i * 7 + salt)) * 3.0f; }

TEST(CpuDeviceMath, AccumulateCopiesThenAddsRoundingTheFloatSumOnce) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    Rig rig;
    std::vector<std::uint8_t> dst(kCount * dtype_size(dtype)), a(dst.size()), b(dst.size());
    for (std::size_t i = 0; i < kCount; ++i) {
      store_from_float(a.data(), dtype, i, value(i, 1));
      store_from_float(b.data(), dtype, i, value(i, 2) / 7.0f);
      store_from_float(dst.data(), dtype, i, 1000.0f);  // overwritten by the first micro-batch
    }
    rig.math->accumulate(dst.data(), a.data(), kCount, dtype, /*first=*/true, *rig.stream);
    rig.math->accumulate(dst.data(), b.data(), kCount, dtype, /*first=*/false, *rig.stream);
    rig.stream->synchronize();
    std::vector<std::uint8_t> expected(dst.size());
    for (std::size_t i = 0; i < kCount; ++i)
      store_from_float(expected.data(), dtype, i,
                       load_as_float(a.data(), dtype, i) + load_as_float(b.data(), dtype, i));
    EXPECT_EQ(std::memcmp(dst.data(), expected.data(), dst.size()), 0) << dtype_name(dtype);
  }
}

TEST(CpuDeviceMath, GradStatsSumsSquaresInDoubleAndFlagsNonfiniteGradients) {
  Rig rig;
  std::vector<float> first(kCount), second(5);
  double expected = 0;
  for (std::size_t i = 0; i < kCount; ++i) expected += double(first[i] = value(i, 3)) * first[i];
  for (std::size_t i = 0; i < second.size(); ++i) expected += double(second[i] = value(i, 4)) * second[i];
  const GradSpan spans[] = {{first.data(), first.size()}, {second.data(), second.size()}};
  GradStatsScalars out{};
  rig.math->grad_stats(spans, DType::f32, &out, *rig.stream);
  rig.stream->synchronize();
  EXPECT_NEAR(out.sum_squares, expected, 1e-9 * expected);
  EXPECT_EQ(out.reduced[0], static_cast<float>(out.sum_squares));
  EXPECT_EQ(out.reduced[1], 0.0f);
  EXPECT_EQ(out.nonfinite, 0);

  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    second[2] = bad;
    GradStatsScalars flagged{};
    rig.math->grad_stats(spans, DType::f32, &flagged, *rig.stream);
    rig.stream->synchronize();
    EXPECT_EQ(flagged.nonfinite, 1);
    EXPECT_EQ(flagged.reduced[0], 0.0f);
    EXPECT_EQ(flagged.reduced[1], 1.0f);
  }

  GradStatsScalars none{};
  none.reduced[0] = 5;
  rig.math->grad_stats({}, DType::f32, &none, *rig.stream);
  rig.stream->synchronize();
  EXPECT_EQ(none.reduced[0], 0.0f);
  EXPECT_EQ(none.sum_squares, 0.0);
}

// One Adam or AdamW step in double, as torch.optim writes it.
void reference_step(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                    const std::vector<float>& raw_grad, const optim::AdamHyperParams& h,
                    const optim::AdamStepArgs& args) {
  const double bias1 = 1 - std::pow(h.beta1, static_cast<double>(args.step));
  const double bias2 = 1 - std::pow(h.beta2, static_cast<double>(args.step));
  for (std::size_t i = 0; i < p.size(); ++i) {
    double g = double(raw_grad[i]) * args.grad_scale * args.clip_coef;
    if (h.type == OptimizerType::adamw) p[i] *= 1 - h.lr * h.weight_decay;
    else g += h.weight_decay * p[i];
    m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
    v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
    p[i] -= h.lr / bias1 * m[i] / (std::sqrt(v[i] / bias2) + h.eps);
  }
}

TEST(CpuDeviceMath, AdamStepEqualsTheReferencePerShardWithItsOwnHyperParameters) {
  const optim::AdamHyperParams own{OptimizerType::adamw, 1e-2, 0.9, 0.999, 1e-8, 0.1};
  const optim::AdamHyperParams other{OptimizerType::adam, 3e-3, 0.8, 0.99, 1e-6, 0.05};
  Rig rig(own);
  const optim::AdamStepArgs args{3, 0.5, 0.75};  // a loss scale of 2 and clipping
  struct Shard {
    std::vector<float> master, m, v, grad;
    std::vector<std::uint16_t> out_bf16;
    std::vector<float> out_f32;
  };
  Shard shards[2];
  for (int s = 0; s < 2; ++s) {
    Shard& x = shards[s];
    for (std::size_t i = 0; i < kCount; ++i) {
      x.master.push_back(value(i, 10 + s));
      x.m.push_back(value(i, 20 + s) / 10);
      x.v.push_back(std::abs(value(i, 30 + s)) / 10);
      x.grad.push_back(value(i, 40 + s));
    }
    x.out_bf16.assign(kCount, 0);
    x.out_f32.assign(kCount, 0);
  }
  std::vector<std::vector<double>> p, m, v;
  for (const Shard& x : shards) {
    p.emplace_back(x.master.begin(), x.master.end());
    m.emplace_back(x.m.begin(), x.m.end());
    v.emplace_back(x.v.begin(), x.v.end());
  }
  // Shard 0 with the math's own values (hyper null), shard 1 with its group's; bf16 parameters out.
  const AdamShard calls[] = {{shards[0].master.data(), shards[0].m.data(), shards[0].v.data(), shards[0].grad.data(),
                              shards[0].out_bf16.data(), kCount, nullptr},
                             {shards[1].master.data(), shards[1].m.data(), shards[1].v.data(), shards[1].grad.data(),
                              shards[1].out_bf16.data(), kCount, &other}};
  rig.math->adam_step(calls, DType::f32, DType::bf16, args, *rig.stream);
  rig.stream->synchronize();
  reference_step(p[0], m[0], v[0], shards[0].grad, own, args);
  reference_step(p[1], m[1], v[1], shards[1].grad, other, args);
  for (int s = 0; s < 2; ++s)
    for (std::size_t i = 0; i < kCount; ++i) {
      EXPECT_NEAR(shards[s].master[i], p[s][i], 2e-6 * (1 + std::abs(p[s][i]))) << "shard " << s << " element " << i;
      EXPECT_NEAR(shards[s].m[i], m[s][i], 2e-6 * (1 + std::abs(m[s][i])));
      EXPECT_NEAR(shards[s].v[i], v[s][i], 2e-6 * (1 + std::abs(v[s][i])));
      EXPECT_EQ(shards[s].out_bf16[i], float_to_bf16(shards[s].master[i])) << "bf16 out is the master rounded";
    }

  // fp32 parameters out: the master weights themselves, copied.
  const AdamShard f32_call[] = {{shards[0].master.data(), shards[0].m.data(), shards[0].v.data(),
                                 shards[0].grad.data(), shards[0].out_f32.data(), kCount, nullptr}};
  rig.math->adam_step(f32_call, DType::f32, DType::f32, {4, 1.0, 1.0}, *rig.stream);
  rig.stream->synchronize();
  EXPECT_EQ(std::memcmp(shards[0].out_f32.data(), shards[0].master.data(), kCount * sizeof(float)), 0);
}

TEST(CpuDeviceMath, PiecesCallsEqualTheDefaultsOfOneCallPerPiece) {
  Rig rig;
  rig.math = make_cpu_device_math({}, 2);
  const std::vector<std::size_t> order{2, 0, 1, 2};
  for (optim::QuantBits bits : {optim::QuantBits::int8, optim::QuantBits::int4}) {
    for (std::size_t piece : {std::size_t{300}, std::size_t{2 * 16384 + 5}}) {
      const std::size_t record = optim::quantized_bytes(bits, piece);
      std::vector<float> in(3 * piece);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(i, static_cast<int>(piece));
      std::vector<float> fused(order.size() * record / 4, -1.0f), one_by_one(fused.size(), -2.0f);
      rig.math->quantize_pieces(in.data(), DType::f32, piece, 3, order, bits, fused.data(), *rig.stream);
      rig.math->DeviceMath::quantize_pieces(in.data(), DType::f32, piece, 3, order, bits, one_by_one.data(),
                                            *rig.stream);
      // 2 sums of 2 terms, and every record decoded to bf16.
      std::vector<float> sums(2 * piece, -1.0f), sums_one_by_one(2 * piece, -2.0f);
      rig.math->dequantize_sum(fused.data(), bits, piece, 2, 2, sums.data(), *rig.stream);
      rig.math->DeviceMath::dequantize_sum(fused.data(), bits, piece, 2, 2, sums_one_by_one.data(), *rig.stream);
      std::vector<std::uint16_t> decoded(order.size() * piece, 1), decoded_one_by_one(decoded.size(), 2);
      rig.math->dequantize_pieces(fused.data(), bits, piece, order.size(), decoded.data(), DType::bf16, *rig.stream);
      rig.math->DeviceMath::dequantize_pieces(fused.data(), bits, piece, order.size(), decoded_one_by_one.data(),
                                              DType::bf16, *rig.stream);
      rig.stream->synchronize();
      const std::string at = "int" + std::to_string(static_cast<int>(bits)) + " piece " + std::to_string(piece);
      EXPECT_EQ(std::memcmp(fused.data(), one_by_one.data(), fused.size() * 4), 0) << at;
      EXPECT_EQ(std::memcmp(sums.data(), sums_one_by_one.data(), sums.size() * 4), 0) << at;
      EXPECT_EQ(decoded, decoded_one_by_one) << at;
      EXPECT_NE(sums[0], -1.0f) << at;  // written
    }
  }
  // An order beyond the input's pieces is refused by the defaults too, naming the record.
  std::vector<float> in(600), out(2 * optim::quantized_bytes(optim::QuantBits::int8, 300) / 4);
  const std::vector<std::size_t> far{0, 2};
  try {
    rig.math->DeviceMath::quantize_pieces(in.data(), DType::f32, 300, 2, far, optim::QuantBits::int8, out.data(),
                                          *rig.stream);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("record 1 takes piece 2 of 2"), std::string::npos) << e.what();
  }
  rig.stream->synchronize();
}

}  // namespace
}  // namespace zest::engine
