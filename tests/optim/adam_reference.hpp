// An independent double-precision Adam/AdamW, written from the PyTorch formulas (not from
// adam_math.hpp), that the CPU and CUDA variants are compared with.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "optim/adam_math.hpp"

namespace zest::optim::test {

struct ReferenceAdam {
  AdamHyperParams hp;
  std::vector<double> p, m, v;

  ReferenceAdam(const AdamHyperParams& hyper, const std::vector<float>& init)
      : hp(hyper), p(init.begin(), init.end()), m(init.size(), 0.0), v(init.size(), 0.0) {}

  // `grad` holds the gradients exactly as the kernel sees them (already widened to float).
  void step(const std::vector<float>& grad, std::int64_t t, double grad_scale, double clip) {
    const double bias1 = 1.0 - std::pow(hp.beta1, static_cast<double>(t));
    const double bias2 = 1.0 - std::pow(hp.beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = static_cast<double>(grad[i]) * grad_scale * clip;
      if (hp.type == OptimizerType::adamw) {
        p[i] *= 1.0 - hp.lr * hp.weight_decay;
      } else {
        g += hp.weight_decay * p[i];
      }
      m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
      v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bias2) + hp.eps;
      p[i] -= hp.lr / bias1 * m[i] / denom;
    }
  }
};

// Largest |got - want| over the elements, divided by max(floor, largest |want|).
inline double max_scaled_error(const float* got, const std::vector<double>& want, double floor) {
  double err = 0.0, scale = floor;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

// Per element: |got - want| <= rel * |want| + abs; returns the worst ratio (<= 1 passes).
inline double worst_ratio(const float* got, const std::vector<double>& want, double rel, double abs) {
  double worst = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double bound = rel * std::fabs(want[i]) + abs;
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]) / bound);
  }
  return worst;
}

}  // namespace zest::optim::test
