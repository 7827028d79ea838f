// Dynamic loss scaling: halves after `hysteresis` overflows, doubles after `window` clean steps,
// never below min_scale; static scaling never moves.
#include "engine/optimizer/loss_scaler.hpp"

#include <gtest/gtest.h>

namespace zest::engine {
namespace {

LossScaleConfig dynamic_config() {
  LossScaleConfig c;
  c.dynamic = true;
  c.initial_scale_power = 4;  // 16
  c.window = 3;
  c.hysteresis = 2;
  c.min_scale = 4;
  return c;
}

TEST(LossScaler, HalvesAfterHysteresisOverflowsAndNeverBelowMinimum) {
  LossScaler scaler(dynamic_config());
  EXPECT_EQ(scaler.scale(), 16);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 16);  // first overflow is tolerated
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 8);
  scaler.update(true);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4);
  scaler.update(true);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4);  // the minimum holds
}

TEST(LossScaler, DoublesAfterWindowCleanSteps) {
  LossScaler scaler(dynamic_config());
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 16);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 32);
  scaler.update(false);
  scaler.update(true);  // an overflow restarts the window
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 32);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 64);
}

TEST(LossScaler, StaticScaleNeverMoves) {
  LossScaleConfig c;
  c.dynamic = false;
  c.static_scale = 128;
  LossScaler scaler(c);
  for (int i = 0; i < 10; ++i) scaler.update(i % 2 == 0);
  EXPECT_EQ(scaler.scale(), 128);
}

}  // namespace
}  // namespace zest::engine
