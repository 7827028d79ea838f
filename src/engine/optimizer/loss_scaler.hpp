// Dynamic loss scaling for fp16 (static 1 otherwise): the scale halves after `hysteresis`
// overflowing steps and doubles after `window` clean ones, never below `min_scale`. Every rank feeds
// it the same agreed overflow flag, so every rank holds the same scale.
#pragma once

#include "zest/config.hpp"

namespace zest::engine {

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config);

  double scale() const { return scale_; }
  // Called once per step with whether any rank saw an Inf/NaN gradient.
  void update(bool overflow);

  // The state a checkpoint keeps, and its restore (the configuration stays this scaler's).
  int clean_steps() const { return clean_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  void restore(double scale, int clean_steps, int hysteresis_left) {
    scale_ = scale;
    clean_steps_ = clean_steps;
    hysteresis_left_ = hysteresis_left;
  }

 private:
  LossScaleConfig config_;
  double scale_;
  int clean_steps_ = 0;
  int hysteresis_left_;
};

}  // namespace zest::engine
