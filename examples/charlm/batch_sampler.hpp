// The training data order: the global batch of step `step` is `global_batch` windows of
// (context + 1) consecutive tokens — `context` inputs, then the next token as the target — whose
// start positions are a pure function of (seed, step, example index). There is no generator state,
// so any rank computes any example, and the loss at step n does not depend on the rank count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "text_corpus.hpp"

namespace zest::charlm {

// A contiguous run of examples of the global batch: indices [first, first + count).
struct ExampleRange {
  std::size_t first = 0;
  std::size_t count = 0;
};

// Rank r of `world` takes the examples [floor(r*B/world), floor((r+1)*B/world)). When world does
// not divide B, slices hold floor(B/world) or ceil(B/world) examples and the larger ones are spread
// evenly over the ranks (not piled on the last). With world > B some ranks get no example; they
// still take part in every collective, with zero loss and zero gradients.
// Throws zest::Error when world < 1 or rank is outside [0, world).
ExampleRange rank_slice(std::size_t global_batch, int rank, int world);

class BatchSampler {
 public:
  // Throws zest::Error when the corpus is shorter than one window or global_batch is 0.
  BatchSampler(std::size_t corpus_tokens, std::size_t context, std::size_t global_batch,
               std::uint64_t seed);

  std::size_t window() const { return context_ + 1; }
  std::size_t global_batch() const { return global_batch_; }

  // Start position in the corpus of example `example` of step `step`; uniform over every start
  // whose window fits.
  std::size_t position(std::uint64_t step, std::size_t example) const;

  // Copies the windows of `range` (of step `step`) one after another into `out`, which must hold
  // exactly range.count * window() tokens. `corpus` must have the length given at construction.
  // Throws zest::Error on a size mismatch or a range outside the global batch.
  void gather(std::span<const Token> corpus, std::uint64_t step, ExampleRange range,
              std::span<Token> out) const;

 private:
  std::size_t corpus_tokens_;
  std::size_t context_;
  std::size_t global_batch_;
  std::uint64_t seed_;
};

}  // namespace zest::charlm
