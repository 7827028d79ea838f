#include "engine/collectives/comm_levels.hpp"

#include <map>
#include <string>

#include <fmt/core.h>

#include "engine/plan/memory_plan.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

struct Levels {
  std::unique_ptr<Communicator> host, across;
};

// Every rank has the same config here (checked just before).
Levels levels_of(const Config& c, Communicator& comm) {
  if (comm.size() == 1) return {};
  const bool secondary = c.stage == 3 && c.partition.secondary == SecondaryPartition::host;
  const bool quantized = quantized_grad_bits(c).has_value();
  if (!secondary && !quantized) return {};
  std::string fallback;  // the keys that need equal hosts
  if (secondary) fallback = "partition.secondary: none";
  if (quantized) fallback.append(secondary ? " and " : "").append("comm.quantize.grads: none");
  std::map<int, int> ranks_on;  // host -> its ranks
  for (int r = 0; r < comm.size(); ++r) ++ranks_on[comm.host_of(r)];
  for (const auto& [host, ranks] : ranks_on)
    if (ranks != ranks_on.begin()->second)
      throw Error(
          fmt::format("this config needs as many ranks on every host, but host {} has {} and host {} has {}; start the "
                      "same number on each, or set {}",
                      ranks_on.begin()->first, ranks_on.begin()->second, host, ranks, fallback));
  Levels levels;
  levels.host = comm.split_by_host();
  if (!levels.host)
    throw Error("the " + comm.backend_name() + " communicator's split_by_host returned nothing; it must return a "
                "communicator or throw");
  // Across hosts only where there are several (every rank knows how many).
  if (quantized && ranks_on.size() > 1) {
    levels.across = comm.split_across_hosts();
    if (!levels.across)
      throw Error("the " + comm.backend_name() + " communicator's split_across_hosts returned nothing; it must "
                  "return a communicator or throw");
  }
  return levels;
}

std::unique_ptr<CountingCommunicator> counting(const std::unique_ptr<Communicator>& level) {
  return level ? std::make_unique<CountingCommunicator>(*level) : nullptr;
}

}  // namespace

EngineComms::EngineComms(const Config& config, Communicator& world, std::span<const SharedValue> shared,
                         const char* who)
    : world_(world) {
  require_same_on_ranks(world, shared, who);
  Levels levels = levels_of(config, world);
  host_level_ = std::move(levels.host);
  across_level_ = std::move(levels.across);
  host_ = counting(host_level_);
  across_ = counting(across_level_);
}

WireBytes EngineComms::sent() const {
  WireBytes w = world_.sent();
  if (host_) w = w + host_->sent();
  if (across_) w = w + across_->sent();
  return w;
}

void EngineComms::end_step() {
  const WireBytes now = sent();
  last_step_ = now - at_last_step_;
  at_last_step_ = now;
}

}  // namespace zest::engine
