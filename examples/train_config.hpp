// zest-train's own config sections: `model:` (the character MLP's size) and `train:` (data,
// batch, steps). They sit in the same YAML file as zest's keys; zest skips them and this reader
// checks them with the same care (file:line:col, what was expected, what was found).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "charlm/char_mlp.hpp"

namespace zest::train {

struct TrainConfig {
  charlm::CharMlpShape model;          // vocab is filled from the corpus
  std::string text = "/usr/share/common-licenses/GPL-3";
  std::uint64_t seed = 1;
  std::size_t global_batch = 64;       // examples per optimizer step, over all ranks
  int steps = 20;                      // the step to stop at (--steps overrides)
  int log_every = 1;
};

// Reads the `model:` and `train:` sections of `path`. Throws zest::ConfigError.
TrainConfig load_train_config(const std::string& path);

}  // namespace zest::train
