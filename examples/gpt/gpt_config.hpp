// zest-gpt's own config sections: `model:` (the transformer's size) and `train:` (data, batch,
// steps, schedule, the parameters without weight decay), beside zest's keys in one YAML file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zest::gpt {

struct GptShape {
  std::int64_t vocab = 0;    // filled from the corpus
  std::int64_t context = 32; // tokens seen at once
  std::int64_t embed = 32;
  std::int64_t heads = 2;    // must divide embed
  std::int64_t layers = 2;
};

struct GptTrainConfig {
  GptShape model;
  std::string text = "/usr/share/common-licenses/GPL-3";
  std::uint64_t seed = 1;
  std::size_t global_batch = 16;  // examples per optimizer step, over all ranks
  int steps = 20;                 // the step to stop at (--steps overrides)
  int log_every = 1;
  // torch::optim::StepLR: the learning rate is multiplied by lr_gamma every lr_step_size steps
  // (0: no schedule).
  int lr_step_size = 0;
  double lr_gamma = 1.0;
  // fnmatch patterns of parameter names trained without weight decay (their own param group).
  std::vector<std::string> no_decay;
};

// Reads the `model:` and `train:` sections of `path`. Throws zest::ConfigError.
GptTrainConfig load_gpt_train_config(const std::string& path);

}  // namespace zest::gpt
