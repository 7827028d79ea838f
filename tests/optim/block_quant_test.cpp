// The block quantizer (src/optim/block_quant.hpp): every instruction-set variant bit for bit equal
// to the scalar reference (block_quant_reference.hpp), the layout by hand, the error bound, zeros,
// Inf and NaN, pieces cut on block boundaries, and the arguments it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "optim/block_quant.hpp"
#include "optim/block_quant_reference.hpp"
#include "optim/supported_isas.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::optim {
namespace {

using test::as_dtype;
using test::mixed_values;
using test::output_bits;
using test::read_float;
using test::reference_quantize;
using test::reference_values;
using test::stored_bits;
using test::supported_isas;
using test::test_counts;

constexpr QuantBits kBits[] = {QuantBits::int8, QuantBits::int4};
constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

// A quantized buffer, 4-byte aligned (the scales are floats).
struct Quantized {
  std::vector<float> storage;
  std::size_t bytes = 0;
  Quantized(QuantBits bits, std::size_t count) : storage(quantized_bytes(bits, count) / 4 + 1, -1.0f),
                                                 bytes(quantized_bytes(bits, count)) {}
  std::span<std::byte> span() { return {reinterpret_cast<std::byte*>(storage.data()), bytes}; }
  std::span<const std::byte> cspan() const { return {reinterpret_cast<const std::byte*>(storage.data()), bytes}; }
  std::vector<std::uint8_t> vec() const {
    const auto* p = reinterpret_cast<const std::uint8_t*>(storage.data());
    return {p, p + bytes};
  }
};

// The reference's buffer in aligned storage.
Quantized quantized_copy(const std::vector<std::uint8_t>& q, QuantBits bits, std::size_t count) {
  Quantized out(bits, count);
  std::memcpy(out.storage.data(), q.data(), q.size());
  return out;
}

std::string where(Isa isa, QuantBits bits, DType dtype, std::size_t count) {
  return std::string(isa_name(isa)) + " int" + std::to_string(static_cast<int>(bits)) + " " +
         std::string(dtype_name(dtype)) + " count " + std::to_string(count);
}

// The first index where two equal-length vectors differ, or -1.
template <class T>
long first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  const auto m = std::mismatch(a.begin(), a.end(), b.begin());
  return m.first == a.end() ? -1 : static_cast<long>(m.first - a.begin());
}

// Each variant's kernels (called directly, one thread) and the threaded front end, quantizing each
// input type and decoding to each output type, equal the reference bit for bit.
TEST(BlockQuant, EveryVariantEqualsTheReferenceBitForBit) {
  for (Isa isa : supported_isas()) {
    const QuantKernels& kernels = quant_kernels(isa);
    BlockQuantizer threaded(3, {}, isa);
    for (QuantBits bits : kBits) {
      for (std::size_t count : test_counts()) {
        const std::vector<float> x = mixed_values(count, static_cast<std::uint32_t>(count));
        for (DType dtype : kDtypes) {
          const std::string at = where(isa, bits, dtype, count);
          const test::TypedValues in = as_dtype(x, dtype);
          const std::vector<std::uint8_t> want = reference_quantize(in.values, bits);
          ASSERT_EQ(want.size(), quantized_bytes(bits, count)) << at;
          Quantized q(bits, count);
          kernels.quantize(in.data(), dtype, count, bits, reinterpret_cast<std::uint8_t*>(q.storage.data()));
          ASSERT_EQ(first_difference(q.vec(), want), -1) << at;
          Quantized threaded_q(bits, count);
          threaded.quantize({in.data(), dtype, count}, bits, threaded_q.span());
          ASSERT_EQ(first_difference(threaded_q.vec(), want), -1) << at << " (threaded)";

          // Decoding the reference's buffer to `dtype`.
          const std::vector<float> values = reference_values(want, bits, count);
          std::vector<float> out(count + 1, -7.0f);  // one spare element that must stay as it is
          kernels.dequantize(reinterpret_cast<const std::uint8_t*>(q.storage.data()), bits, count, out.data(), dtype);
          ASSERT_EQ(first_difference(output_bits(out.data(), dtype, count), stored_bits(values, dtype)), -1) << at;
          const std::vector<float> untouched(count + 1, -7.0f);
          const std::size_t end_bytes = count * dtype_size(dtype);
          EXPECT_EQ(std::memcmp(reinterpret_cast<const unsigned char*>(out.data()) + end_bytes,
                                reinterpret_cast<const unsigned char*>(untouched.data()) + end_bytes,
                                (count + 1) * sizeof(float) - end_bytes),
                    0)
              << at << ": written past the end";
          std::fill(out.begin(), out.end(), -7.0f);
          threaded.dequantize(q.cspan(), bits, {out.data(), dtype, count});
          ASSERT_EQ(first_difference(output_bits(out.data(), dtype, count), stored_bits(values, dtype)), -1)
              << at << " (threaded)";
        }

        // Adding into an fp32 accumulator: acc + code * scale, each rounded in fp32.
        const std::vector<std::uint8_t> want = reference_quantize(x, bits);
        const std::vector<float> values = reference_values(want, bits, count);
        std::vector<float> acc = mixed_values(count, 99);
        std::vector<float> expected(count);
        for (std::size_t i = 0; i < count; ++i) expected[i] = acc[i] + values[i];
        std::vector<float> threaded_acc = acc;
        const Quantized q = quantized_copy(want, bits, count);
        kernels.dequantize_add(reinterpret_cast<const std::uint8_t*>(q.storage.data()), bits, count, acc.data());
        const std::string at = where(isa, bits, DType::f32, count);
        ASSERT_EQ(first_difference(stored_bits(acc, DType::f32), stored_bits(expected, DType::f32)), -1) << at;
        threaded.dequantize_add(q.cspan(), bits, threaded_acc);
        ASSERT_EQ(first_difference(stored_bits(threaded_acc, DType::f32), stored_bits(expected, DType::f32)), -1)
            << at << " (threaded)";
      }
    }
  }
}

// The layout and the rounding by hand, for the reference itself and the kernels.
TEST(BlockQuant, LayoutAndRoundingByHand) {
  EXPECT_EQ(quantized_bytes(QuantBits::int8, 0), 0u);
  EXPECT_EQ(quantized_bytes(QuantBits::int8, 256), 260u);
  EXPECT_EQ(quantized_bytes(QuantBits::int4, 256), 132u);
  EXPECT_EQ(quantized_bytes(QuantBits::int8, 257), 268u);  // 260 + 4 + one code padded to 4
  EXPECT_EQ(quantized_bytes(QuantBits::int4, 1), 8u);
  EXPECT_EQ(quantized_bytes(QuantBits::int4, 9), 12u);     // 5 code bytes padded to 8
  EXPECT_EQ(quantized_bytes(QuantBits::int8, 1000), 3 * 260u + 4 + 232);

  // int4, absmax 7: scale 1, codes round half to even, -7..7 in two's complement nibbles.
  const std::vector<float> x4{7.0f, -7.0f, 2.5f, -2.5f, 1.5f, 0.5f, -0.4f, 3.5f, 6.0f};
  const std::vector<std::uint8_t> want4{0x00, 0x00, 0x80, 0x3f,  // scale 1.0f
                                        0x97, 0xe2, 0x02, 0x40, 0x06, 0, 0, 0};
  EXPECT_EQ(reference_quantize(x4, QuantBits::int4), want4);
  // int8, absmax 254: scale 2, 3 -> 1.5 -> 2, 5 -> 2.5 -> 2, -1 -> -0.5 -> 0.
  const std::vector<float> x8{254.0f, 3.0f, 5.0f, -1.0f, -254.0f};
  const std::vector<std::uint8_t> want8{0x00, 0x00, 0x00, 0x40, 0x7f, 0x02, 0x02, 0x00, 0x81, 0, 0, 0};
  EXPECT_EQ(reference_quantize(x8, QuantBits::int8), want8);
  for (Isa isa : supported_isas()) {
    BlockQuantizer quantizer(1, {}, isa);
    Quantized q4(QuantBits::int4, x4.size());
    quantizer.quantize({x4.data(), DType::f32, x4.size()}, QuantBits::int4, q4.span());
    EXPECT_EQ(q4.vec(), want4) << isa_name(isa);
    Quantized q8(QuantBits::int8, x8.size());
    quantizer.quantize({x8.data(), DType::f32, x8.size()}, QuantBits::int8, q8.span());
    EXPECT_EQ(q8.vec(), want8) << isa_name(isa);
    std::vector<float> back(x4.size());
    quantizer.dequantize(q4.cspan(), QuantBits::int4, {back.data(), DType::f32, back.size()});
    EXPECT_EQ(back, (std::vector<float>{7, -7, 2, -2, 2, 0, 0, 4, 6})) << isa_name(isa);
  }
}

// |x - deq(q(x))| <= scale / 2 plus the rounding of code * scale (and of the output type), on every
// kind of block; where the scale is subnormal, plus qmax * 2^-150 (block_quant_math.hpp). The
// bound is reached: on ordinary data some element's error exceeds 0.45 of it, so a quantizer that
// truncated instead of rounding, or used a larger scale, would fail here.
TEST(BlockQuant, ErrorIsAtMostHalfAScale) {
  BlockQuantizer quantizer(2);
  for (QuantBits bits : kBits) {
    const int qmax = test::reference_qmax(bits);
    for (std::size_t count : {std::size_t{257}, std::size_t{2049}, std::size_t{70001}}) {
      for (DType in_dtype : kDtypes) {
        const test::TypedValues in = as_dtype(mixed_values(count, 7 + static_cast<std::uint32_t>(count)), in_dtype);
        Quantized q(bits, count);
        quantizer.quantize({in.data(), in_dtype, count}, bits, q.span());
        const auto* records = reinterpret_cast<const std::uint8_t*>(q.storage.data());
        for (DType out_dtype : kDtypes) {
          std::vector<float> out(count);
          quantizer.dequantize(q.cspan(), bits, {out.data(), out_dtype, count});
          double worst = 0.0;  // the largest error / (scale / 2) over blocks with a normal scale
          for (std::size_t i = 0; i < count; ++i) {
            const std::size_t block = i / kQuantBlock;
            const float scale = read_float(records + block * quant_record_bytes(bits, kQuantBlock));
            const float value = load_as_float(out.data(), out_dtype, i);
            const double x = in.values[i];
            const double magnitude = std::fabs(static_cast<double>(value));
            double bound = scale / 2.0 + magnitude * 0x1p-24;
            if (scale < std::numeric_limits<float>::min()) bound += qmax * 0x1p-150;
            if (out_dtype == DType::bf16) bound += magnitude * 0x1p-8 + 0x1p-134;
            if (out_dtype == DType::f16) bound += magnitude * 0x1p-11 + 0x1p-25;
            const double error = std::fabs(x - value);
            ASSERT_LE(error, bound) << "int" << static_cast<int>(bits) << " " << dtype_name(in_dtype) << " -> "
                                    << dtype_name(out_dtype) << " element " << i << ": x " << x << " decoded "
                                    << value << " scale " << scale;
            if (out_dtype == DType::f32 && scale >= std::numeric_limits<float>::min())
              worst = std::max(worst, error / (scale / 2.0));
          }
          if (out_dtype == DType::f32) {
            EXPECT_GT(worst, 0.45) << "the bound is never approached: is it right?";
          }
        }
      }
    }
  }
}

// A block of zeros has scale 0 and decodes to +0; added, it leaves the accumulator as it was.
TEST(BlockQuant, ZeroBlockHasScaleZeroAndDecodesToZero) {
  BlockQuantizer quantizer(1);
  for (QuantBits bits : kBits) {
    std::vector<float> x(300, 0.0f);
    x[5] = -0.0f;
    x[299] = 1.0f;  // the second (partial) block is not zero
    Quantized q(bits, x.size());
    quantizer.quantize({x.data(), DType::f32, x.size()}, bits, q.span());
    const auto* records = reinterpret_cast<const std::uint8_t*>(q.storage.data());
    EXPECT_EQ(test::stored_bits({read_float(records)}, DType::f32)[0], 0u);
    for (std::size_t i = 4; i < quant_record_bytes(bits, kQuantBlock); ++i) ASSERT_EQ(records[i], 0) << i;
    std::vector<float> out(x.size(), 5.0f);
    quantizer.dequantize(q.cspan(), bits, {out.data(), DType::f32, out.size()});
    for (std::size_t i = 0; i < kQuantBlock; ++i) ASSERT_EQ(test::stored_bits({out[i]}, DType::f32)[0], 0u) << i;
    EXPECT_EQ(out[299], 1.0f);
    std::vector<float> acc(x.size(), 2.5f);
    quantizer.dequantize_add(q.cspan(), bits, acc);
    for (std::size_t i = 0; i < kQuantBlock; ++i) ASSERT_EQ(acc[i], 2.5f) << i;
  }
}

// An Inf or NaN anywhere in a block makes its scale NaN and its codes 0: the whole block decodes to
// NaN (the receiver's overflow check sees it), in every output type and added to an accumulator;
// the other blocks are as if quantized alone.
TEST(BlockQuant, NonfiniteBlockDecodesToNan) {
  for (Isa isa : supported_isas()) {
    BlockQuantizer quantizer(1, {}, isa);
    for (QuantBits bits : kBits) {
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
        for (DType dtype : kDtypes) {
          const std::size_t count = 3 * kQuantBlock - 9;
          std::vector<float> x = mixed_values(count, 5);
          x[kQuantBlock + 17] = bad;
          const test::TypedValues in = as_dtype(x, dtype);
          const std::string at = where(isa, bits, dtype, count) + " bad " + std::to_string(bad);
          Quantized q(bits, count);
          quantizer.quantize({in.data(), dtype, count}, bits, q.span());
          ASSERT_EQ(q.vec(), reference_quantize(in.values, bits)) << at;
          const auto* records = reinterpret_cast<const std::uint8_t*>(q.storage.data());
          const std::size_t record = quant_record_bytes(bits, kQuantBlock);
          EXPECT_EQ(test::stored_bits({read_float(records + record)}, DType::f32)[0], 0x7fc00000u) << at;
          for (std::size_t i = 4; i < record; ++i) ASSERT_EQ(records[record + i], 0) << at;
          std::vector<float> out(count);
          quantizer.dequantize(q.cspan(), bits, {out.data(), dtype, count});
          for (std::size_t i = 0; i < count; ++i) {
            ASSERT_EQ(std::isnan(load_as_float(out.data(), dtype, i)), i / kQuantBlock == 1) << at << " element " << i;
          }
          std::vector<float> acc(count, 1.0f);
          quantizer.dequantize_add(q.cspan(), bits, acc);
          for (std::size_t i = 0; i < count; ++i)
            ASSERT_EQ(std::isnan(acc[i]), i / kQuantBlock == 1) << at << " element " << i;
        }
      }
    }
  }
}

// As documented: int8 decodes a block whose absmax is FLT_MAX to Inf at that element (127 times
// the rounded scale passes FLT_MAX); int4 stays finite. Both are nonfinite-free on the way in.
TEST(BlockQuant, LargestFloatsAsDocumented) {
  BlockQuantizer quantizer(1);
  const float big = std::numeric_limits<float>::max();
  const std::vector<float> x{big, -big / 2, 1.0f};
  std::vector<float> out(x.size());
  Quantized q8(QuantBits::int8, x.size());
  quantizer.quantize({x.data(), DType::f32, x.size()}, QuantBits::int8, q8.span());
  quantizer.dequantize(q8.cspan(), QuantBits::int8, {out.data(), DType::f32, out.size()});
  EXPECT_TRUE(std::isinf(out[0]));
  EXPECT_TRUE(std::isfinite(out[1]));
  Quantized q4(QuantBits::int4, x.size());
  quantizer.quantize({x.data(), DType::f32, x.size()}, QuantBits::int4, q4.span());
  quantizer.dequantize(q4.cspan(), QuantBits::int4, {out.data(), DType::f32, out.size()});
  EXPECT_EQ(out[0], big);
}

// Pieces cut on block boundaries quantize to the bytes of the whole: what a collective needs to
// send each rank its part of one buffer.
TEST(BlockQuant, PiecesOnBlockBoundariesAreTheWholeBuffersBytes) {
  BlockQuantizer quantizer(2);
  for (QuantBits bits : kBits) {
    const std::size_t count = 70001;
    const std::vector<float> x = mixed_values(count, 3);
    Quantized whole(bits, count);
    quantizer.quantize({x.data(), DType::f32, count}, bits, whole.span());
    std::vector<std::uint8_t> joined;
    for (std::size_t first : {std::size_t{0}, std::size_t{256 * 7}, std::size_t{256 * 100}}) {
      const std::size_t end = first == 0 ? 256 * 7 : first == 256 * 7 ? 256 * 100 : count;
      Quantized piece(bits, end - first);
      quantizer.quantize({x.data() + first, DType::f32, end - first}, bits, piece.span());
      const std::vector<std::uint8_t> bytes = piece.vec();
      joined.insert(joined.end(), bytes.begin(), bytes.end());
    }
    EXPECT_EQ(joined, whole.vec());
  }
}

// `call` throws zest::Error whose message holds each of `words`.
void expect_error(const std::function<void()>& call, std::initializer_list<const char*> words) {
  try {
    call();
    ADD_FAILURE() << "no zest::Error; expected one saying " << *words.begin();
  } catch (const Error& e) {
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(BlockQuant, RefusesBadArgumentsSayingWhatToDo) {
  BlockQuantizer quantizer(1);
  std::vector<float> x(300, 1.0f);
  Quantized q(QuantBits::int8, x.size());
  const ConstTensorSpan good{x.data(), DType::f32, x.size()};
  // A misaligned input, quantized buffer, output and accumulator.
  const auto* shifted = reinterpret_cast<const unsigned char*>(x.data()) + 2;
  expect_error(
      [&] {
        quantizer.quantize({shifted, DType::f32, 10}, QuantBits::int8, Quantized(QuantBits::int8, 10).span());
      },
      {"input", "4-byte aligned", "pass an aligned buffer"});
  expect_error(
      [&] {
        quantizer.quantize({shifted + 1, DType::bf16, 10}, QuantBits::int8, Quantized(QuantBits::int8, 10).span());
      },
      {"input", "2-byte aligned"});
  Quantized spare(QuantBits::int8, x.size() + 8);
  expect_error([&] { quantizer.quantize(good, QuantBits::int8, spare.span().subspan(2, q.bytes)); },
               {"quantized buffer", "4-byte aligned", "record boundaries"});
  expect_error(
      [&] {
        quantizer.dequantize(spare.cspan().subspan(2, q.bytes), QuantBits::int8, {x.data(), DType::f32, x.size()});
      },
      {"quantized buffer", "4-byte aligned"});
  std::vector<float> out(x.size() + 1);
  expect_error(
      [&] {
        quantizer.dequantize(q.cspan(), QuantBits::int8,
                             {reinterpret_cast<unsigned char*>(out.data()) + 1, DType::f16, x.size()});
      },
      {"output", "2-byte aligned"});
  expect_error(
      [&] {
        quantizer.dequantize_add(
            q.cspan(), QuantBits::int8,
            std::span<float>(reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(out.data()) + 1), x.size()));
      },
      {"output", "4-byte aligned"});
  // Unsupported element types and formats.
  expect_error([&] { quantizer.quantize({x.data(), static_cast<DType>(7), x.size()}, QuantBits::int8, q.span()); },
               {"element type 7", "DType::f32, DType::bf16 or DType::f16"});
  expect_error([&] { quantizer.dequantize(q.cspan(), QuantBits::int8, {out.data(), static_cast<DType>(3), x.size()}); },
               {"element type 3"});
  expect_error([&] { quantizer.quantize(good, static_cast<QuantBits>(2), q.span()); },
               {"2 bits", "QuantBits::int8 or QuantBits::int4"});
  // Sizes, null and overlap.
  expect_error([&] { quantizer.quantize(good, QuantBits::int4, q.span()); },
               {"has 308 bytes", "300 elements quantized to int4 take 160", "exactly that size"});
  expect_error([&] { quantizer.dequantize_add(q.cspan(), QuantBits::int8, std::span<float>(out.data(), 290)); },
               {"quantized_bytes"});
  expect_error([&] { quantizer.quantize({nullptr, DType::f32, x.size()}, QuantBits::int8, q.span()); },
               {"input is null"});
  expect_error(
      [&] {
        quantizer.quantize(
            {x.data(), DType::f32, 64}, QuantBits::int8,
            std::span<std::byte>(reinterpret_cast<std::byte*>(x.data()) + 8, quantized_bytes(QuantBits::int8, 64)));
      },
      {"overlaps", "separate buffers"});
  expect_error([] { BlockQuantizer(0); }, {"thread count", "at least 1"});
  // Nothing at all is fine.
  quantizer.quantize({nullptr, DType::f32, 0}, QuantBits::int8, {});
  quantizer.dequantize({}, QuantBits::int4, {nullptr, DType::bf16, 0});
  quantizer.dequantize_add({}, QuantBits::int4, {});
}

// The 16-bit cast of uncompressed collectives: every variant's kernel and the threaded front end
// equal half.hpp's scalar rounding (nearest even; NaN quiet, overflow to Inf) on every element,
// whatever the count's tail; it refuses what it cannot cast, saying what to pass.
TEST(BlockQuant, CastFromF32EqualsTheScalarRoundingOnEveryVariant) {
  const float specials[] = {INFINITY, -INFINITY, std::nanf(""), -std::nanf("0x12345"), 65504.0f, 65520.0f, 1e5f,
                            1.00390625f, 1.0f + 0x1p-8f + 0x1p-9f, 6e-8f, 3e-8f, 1e-40f, -0.0f, 3.3e38f};
  for (std::size_t count : test_counts()) {
    std::vector<float> x = mixed_values(count, static_cast<std::uint32_t>(count));
    for (std::size_t i = 0; i < count && i < std::size(specials); ++i) x[(i * 7919) % count] = specials[i];
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      const std::vector<std::uint32_t> want = stored_bits(x, dtype);
      for (Isa isa : supported_isas()) {
        std::vector<float> out(count, -1.0f);
        quant_kernels(isa).cast_from_f32(x.data(), count, out.data(), dtype);
        EXPECT_EQ(first_difference(output_bits(out.data(), dtype, count), want), -1)
            << isa_name(isa) << " kernel " << dtype_name(dtype) << " " << count;
        std::fill(out.begin(), out.end(), -1.0f);
        BlockQuantizer(2, {}, isa).cast_from_f32(x, TensorSpan{out.data(), dtype, count});
        EXPECT_EQ(first_difference(output_bits(out.data(), dtype, count), want), -1)
            << isa_name(isa) << " threaded " << dtype_name(dtype) << " " << count;
      }
    }
  }
  BlockQuantizer quantizer(1);
  std::vector<float> x(300, 1.0f), out(300);
  expect_error([&] { quantizer.cast_from_f32(x, {out.data(), DType::bf16, 299}); },
               {"299 elements for 300 values", "same count"});
  expect_error([&] { quantizer.cast_from_f32(x, {x.data() + 100, DType::bf16, 300}); },
               {"output overlaps the input", "separate buffers"});
  expect_error([&] { quantizer.cast_from_f32(x, {out.data(), static_cast<DType>(9), 300}); }, {"element type 9"});
  expect_error([&] { quantizer.cast_from_f32(x, {reinterpret_cast<unsigned char*>(out.data()) + 1, DType::f16, 300}); },
               {"output", "2-byte aligned"});
}

// The pieces calls of the quantized collectives (quantize_pieces, dequantize_sum,
// dequantize_pieces) give the bytes and bits of one call per piece, on every variant, one thread
// and threaded, for pieces of one element, of a partial block and of several tiles; and refuse
// what does not fit.
TEST(BlockQuant, PiecesCallsEqualOneCallPerPiece) {
  const std::vector<std::size_t> order{3, 0, 4, 4, 1, 2};  // repeats allowed: the records are copies
  for (Isa isa : supported_isas()) {
    for (int threads : {1, 3}) {
      BlockQuantizer quantizer(threads, {}, isa);
      for (QuantBits bits : kBits) {
        for (std::size_t piece :
             {std::size_t{1}, std::size_t{300}, 2 * BlockQuantizer::kTileBlocks * kQuantBlock + 77}) {
          const std::size_t record = quantized_bytes(bits, piece);
          for (DType dtype : {DType::f32, DType::bf16}) {
            const std::string at = where(isa, bits, dtype, piece) + " threads " + std::to_string(threads);
            const test::TypedValues in =
                as_dtype(mixed_values(5 * piece, 11 + static_cast<std::uint32_t>(piece)), dtype);
            std::vector<std::uint8_t> want;
            for (std::size_t r : order) {
              Quantized one(bits, piece);
              quantizer.quantize(
                  {static_cast<const unsigned char*>(in.data()) + r * piece * dtype_size(dtype), dtype, piece}, bits,
                  one.span());
              const std::vector<std::uint8_t> bytes = one.vec();
              want.insert(want.end(), bytes.begin(), bytes.end());
            }
            std::vector<float> got(order.size() * record / 4 + 1, -1.0f);
            quantizer.quantize_pieces({in.data(), dtype, 5 * piece}, piece, order, bits,
                                      {reinterpret_cast<std::byte*>(got.data()), order.size() * record});
            ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << at;
          }
          // 2 sums of 3 terms over the six records above (f32 pieces): sum s adds records s, 2 + s, 4 + s.
          const std::vector<float> x = mixed_values(5 * piece, 3 + static_cast<std::uint32_t>(piece));
          std::vector<float> records(order.size() * record / 4 + 1);
          const std::span<const std::byte> codes{reinterpret_cast<const std::byte*>(records.data()),
                                                 order.size() * record};
          quantizer.quantize_pieces({x.data(), DType::f32, x.size()}, piece, order, bits,
                                    {reinterpret_cast<std::byte*>(records.data()), codes.size()});
          std::vector<float> want(2 * piece);
          for (std::size_t s = 0; s < 2; ++s)
            for (std::size_t t = 0; t < 3; ++t) {
              const auto term = codes.subspan((2 * t + s) * record, record);
              if (t == 0) quantizer.dequantize(term, bits, {want.data() + s * piece, DType::f32, piece});
              else quantizer.dequantize_add(term, bits, {want.data() + s * piece, piece});
            }
          std::vector<float> sums(2 * piece, -1.0f);
          quantizer.dequantize_sum(codes, bits, piece, 3, sums);
          const std::string at = where(isa, bits, DType::f32, piece) + " threads " + std::to_string(threads);
          EXPECT_EQ(first_difference(stored_bits(sums, DType::f32), stored_bits(want, DType::f32)), -1) << at;
          for (DType dtype : {DType::f32, DType::f16}) {
            std::vector<float> one(order.size() * piece, -1.0f), all(order.size() * piece, -1.0f);
            for (std::size_t r = 0; r < order.size(); ++r)
              quantizer.dequantize(
                  codes.subspan(r * record, record), bits,
                  {reinterpret_cast<unsigned char*>(one.data()) + r * piece * dtype_size(dtype), dtype, piece});
            quantizer.dequantize_pieces(codes, bits, piece, {all.data(), dtype, order.size() * piece});
            EXPECT_EQ(first_difference(output_bits(all.data(), dtype, all.size()),
                                       output_bits(one.data(), dtype, one.size())),
                      -1)
                << at << " " << dtype_name(dtype);
          }
        }
      }
    }
  }
  BlockQuantizer quantizer(1);
  std::vector<float> x(600, 1.0f), out(2 * quantized_bytes(QuantBits::int8, 300) / 4);
  const std::span<std::byte> codes{reinterpret_cast<std::byte*>(out.data()), out.size() * 4};
  const std::vector<std::size_t> far{0, 2};
  expect_error([&] { quantizer.quantize_pieces({x.data(), DType::f32, 600}, 300, far, QuantBits::int8, codes); },
               {"record 1 takes piece 2", "holds 2"});
  expect_error([&] { quantizer.quantize_pieces({x.data(), DType::f32, 599}, 300, order, QuantBits::int8, codes); },
               {"599 elements, not a whole number of pieces of 300"});
  const std::vector<std::size_t> two{0, 1};
  expect_error(
      [&] {
        quantizer.quantize_pieces({x.data(), DType::f32, 600}, 300, two, QuantBits::int8, codes.first(8));
      },
      {"2 records of 300 elements take", "exactly that size"});
  expect_error([&] { quantizer.dequantize_sum(codes, QuantBits::int8, 300, 0, x); }, {"at least one term"});
  expect_error([&] { quantizer.dequantize_sum(codes, QuantBits::int8, 300, 2, x); },
               {"4 records of 300 elements take"});  // 2 terms of 2 sums, where the codes hold 2 records
  expect_error([&] { quantizer.dequantize_pieces(codes, QuantBits::int8, 300, {x.data(), DType::f32, 301}); },
               {"301 elements, not a whole number"});
}

}  // namespace
}  // namespace zest::optim
