#include "batch_sampler.hpp"

#include <algorithm>
#include <string>

#include <fmt/core.h>

#include "counter_rng.hpp"
#include "zest/error.hpp"

namespace zest::charlm {

ExampleRange rank_slice(std::size_t global_batch, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw Error(fmt::format("rank_slice: rank {} of world {} is not a valid rank (need 0 <= rank < world, world >= 1)",
                            rank, world));
  }
  // floor(r*B/N) with B = q*N + rem is r*q + floor(r*rem/N): no product of r and B to overflow.
  const auto n = static_cast<std::size_t>(world);
  const std::size_t q = global_batch / n;
  const std::size_t rem = global_batch % n;
  const auto boundary = [&](std::size_t r) { return r * q + r * rem / n; };
  const auto r = static_cast<std::size_t>(rank);
  return {boundary(r), boundary(r + 1) - boundary(r)};
}

BatchSampler::BatchSampler(std::size_t corpus_tokens, std::size_t context,
                           std::size_t global_batch, std::uint64_t seed)
    : corpus_tokens_(corpus_tokens), context_(context), global_batch_(global_batch), seed_(seed) {
  if (context == 0 || corpus_tokens < context + 1) {
    throw Error(
        fmt::format("batch sampler: a window of context {} + 1 tokens does not fit in a corpus of {} tokens; use "
                    "a context of at least 1 and a longer text or a shorter context",
                    context, corpus_tokens));
  }
  if (global_batch == 0) {
    throw Error("batch sampler: the global batch size is 0; set it to at least 1");
  }
}

std::size_t BatchSampler::position(std::uint64_t step, std::size_t example) const {
  const std::uint64_t starts = corpus_tokens_ - window() + 1;
  return static_cast<std::size_t>(below(counter_hash(seed_ ^ kSamplerStream, step, example, 0), starts));
}

void BatchSampler::gather(std::span<const Token> corpus, std::uint64_t step, ExampleRange range,
                          std::span<Token> out) const {
  if (corpus.size() != corpus_tokens_) {
    throw Error(fmt::format("batch sampler: built for a corpus of {} tokens but given one of {}", corpus_tokens_,
                            corpus.size()));
  }
  if (range.first > global_batch_ || range.count > global_batch_ - range.first) {
    throw Error(fmt::format("batch sampler: examples [{}, {}) are outside the global batch of {}", range.first,
                            range.first + range.count, global_batch_));
  }
  if (out.size() != range.count * window()) {
    throw Error(fmt::format("batch sampler: the output holds {} tokens but {} windows of {} need {}", out.size(),
                            range.count, window(), range.count * window()));
  }
  for (std::size_t i = 0; i < range.count; ++i) {
    const std::size_t start = position(step, range.first + i);
    std::copy_n(corpus.begin() + static_cast<std::ptrdiff_t>(start), window(),
                out.begin() + static_cast<std::ptrdiff_t>(i * window()));
  }
}

}  // namespace zest::charlm
