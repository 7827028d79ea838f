// EngineComms: the communicators an engine speaks over, and what they send. The program's (the
// world); where the config needs them, this rank's host's ranks (partition.secondary: host at
// stage 3, comm.quantize.grads) and the ranks holding its place on every host (comm.quantize.grads,
// several hosts); each wrapped to count the bytes this rank sends, and the step's share of them.
// Threading: the engine's host thread (sent() may be read from any thread: the counts are atomic).
#pragma once

#include <memory>
#include <span>

#include "runtime/comm/counting_communicator.hpp"
#include "runtime/comm/same_on_ranks.hpp"
#include "zest/config.hpp"

namespace zest::engine {

class EngineComms {
 public:
  // One collective first checks that the ranks share `shared` (require_same_on_ranks, naming
  // `who`): the levels below are built from the config, which must be the same everywhere. Throws
  // Error on every rank where the ranks differ, where the config needs levels and hosts hold
  // unequal numbers of ranks (naming the keys to turn off), or where the world's backend returns
  // no communicator for a level. `world` must outlive this.
  EngineComms(const Config& config, Communicator& world, std::span<const SharedValue> shared, const char* who);

  CountingCommunicator& world() { return world_; }
  // Null where no part of this config needs it (and at one rank).
  CountingCommunicator* host() { return host_.get(); }
  CountingCommunicator* across() { return across_.get(); }
  // The host communicator's rank count; 0 without one.
  int host_size() const { return host_ ? host_->size() : 0; }

  // Bytes sent over all three since construction.
  WireBytes sent() const;
  // Closes a step: what was sent since the last close (or construction) becomes last_step().
  void end_step();
  WireBytes last_step() const { return last_step_; }

 private:
  CountingCommunicator world_;
  std::unique_ptr<Communicator> host_level_, across_level_;  // the backend's, under the counters
  std::unique_ptr<CountingCommunicator> host_, across_;
  WireBytes at_last_step_;  // sent() at the last end_step()
  WireBytes last_step_;
};

}  // namespace zest::engine
