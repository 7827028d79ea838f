#include "engine/optimizer/loss_scaler.hpp"

#include <algorithm>
#include <cmath>

namespace zest::engine {

LossScaler::LossScaler(const LossScaleConfig& config)
    : config_(config),
      scale_(config.dynamic ? std::ldexp(1.0, config.initial_scale_power) : config.static_scale),
      hysteresis_left_(config.hysteresis) {}

void LossScaler::update(bool overflow) {
  if (!config_.dynamic) return;
  if (overflow) {
    clean_steps_ = 0;
    if (--hysteresis_left_ <= 0) {
      scale_ = std::max(config_.min_scale, scale_ / 2);
      hysteresis_left_ = config_.hysteresis;
    }
    return;
  }
  if (++clean_steps_ >= config_.window) {
    scale_ *= 2;
    clean_steps_ = 0;
    hysteresis_left_ = config_.hysteresis;
  }
}

}  // namespace zest::engine
