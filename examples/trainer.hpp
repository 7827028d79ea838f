// The training loop of the character MLP on a zest Engine, shared by zest-train and the memory
// benchmark. The model computes in fp32 on the host; zest owns parameters, gradients and optimizer
// states on the device in the stage and precision the config chooses. Rank r trains on its slice of
// each step's global batch; the batch is a function of (seed, step) alone.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "charlm/batch_sampler.hpp"
#include "charlm/char_mlp.hpp"
#include "charlm/text_corpus.hpp"
#include "train_config.hpp"
#include "zest/zest.hpp"

namespace zest::train {

class Trainer {
 public:
  // Builds the model and the Engine on `device`/`comm` and sets the initial weights from the seed.
  // Throws OutOfDeviceMemory when the stage's share of the model does not fit the device.
  Trainer(const Config& config, const TrainConfig& train, const charlm::TextCorpus& corpus, Device& device,
          Communicator& comm, int blas_threads);
  ~Trainer();

  // One optimizer step (every micro-batch); returns the loss of the whole global batch.
  double step(int step);
  const StepResult& last_result() const { return last_; }
  Engine& engine() { return *engine_; }

 private:
  class Binding;

  const TrainConfig train_;
  const int accumulation_;
  const charlm::TextCorpus& corpus_;
  Device& device_;
  Communicator& comm_;
  charlm::CharMlp model_;
  charlm::BatchSampler sampler_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Binding> binding_;
  std::vector<charlm::Token> windows_;
  std::unique_ptr<Stream> stream_;
  DeviceBuffer loss_;
  HostBuffer loss_host_;
  StepResult last_;
};

// The model's parameter list as the Engine takes it.
std::vector<ParamSpec> engine_params(const charlm::CharMlp& model);

}  // namespace zest::train
