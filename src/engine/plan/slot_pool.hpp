// Reusable device buffers (gradient buckets, gathered parameters), each with the event that marks
// the end of its last use on the comm stream: a slot is taken by a group, and handed back without
// waiting; the next taker waits for that event, so a buffer is never rewritten while a collective
// or copy still reads it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "zest/device.hpp"

namespace zest::engine {

struct Slot {
  DeviceBuffer buffer;
  std::unique_ptr<Event> free_after;
  int owner = -1;      // the group using it, or -1
  DeviceBuffer shard;  // stage 3 with offloaded parameters: the fetched shard the gather reads
};

class SlotPool {
 public:
  // `what` names the buffers in errors ("gradient bucket"); `remedy` says how to need fewer.
  SlotPool(std::string what, std::string remedy) : what_(std::move(what)), remedy_(std::move(remedy)) {}

  void add(Slot slot) { slots_.push_back(std::move(slot)); }
  std::size_t size() const { return slots_.size(); }
  Slot& operator[](std::size_t i) { return slots_[i]; }
  const Slot& operator[](std::size_t i) const { return slots_[i]; }
  bool any_free() const;

  // A free slot for `group` (its last use finished: waits for it); throws Error when every slot
  // is taken, saying how many there are and `remedy`.
  int take(int group);
  // Hands a slot back; its event must already be recorded after its last use.
  void give_back(int slot) { slots_[static_cast<std::size_t>(slot)].owner = -1; }

  auto begin() { return slots_.begin(); }
  auto end() { return slots_.end(); }
  auto begin() const { return slots_.begin(); }
  auto end() const { return slots_.end(); }

 private:
  std::vector<Slot> slots_;
  std::string what_, remedy_;
};

}  // namespace zest::engine
