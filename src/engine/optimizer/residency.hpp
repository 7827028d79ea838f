// Where offloaded data lives between its uses: the optimizer states of OffloadedOptimizer (one
// piece per sub-group: its master weights, m and v, side by side) and stage 3's parameter shards
// of ParamOffload (one piece per group). The owner works on a piece where data() says, between a
// load() and a store():
//   PinnedResidency   every piece in a pinned array, used in place: load and store move nothing
//                     (offload device cpu);
//   NvmeResidency     every piece in a region of an offload::Store (the NVMe swap file), brought
//                     into one of `slots` pinned staging slots by load() and written back from it
//                     by store() (offload device nvme).
// So the owner's pipeline (read next, compute this, write previous) is written once for both.
//
// A residency may keep two copies of each piece (offload.optimizer.update_ahead): an update ahead
// of the step reads the current copy and writes the spare one, and promote() makes the spare
// current once the step keeps that work; the current copy is never written ahead, so dropping the
// work costs nothing. Threading: one thread at a time (the owner's host thread, or the thread that
// updates ahead while the host thread waits for it); store transfers complete on the store's
// threads.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "offload/io_handle.hpp"
#include "offload/store.hpp"
#include "zest/device.hpp"
#include "zest/host_purpose.hpp"

namespace zest::engine {

enum class Copy { current, spare };

class Residency {
 public:
  virtual ~Residency() = default;

  // Where `piece`'s `copy` is while staging slot `slot` holds it: its place in the pinned array, or
  // the slot. Valid once load() completed (and, for a slot, until the slot is loaded again).
  virtual char* data(std::size_t piece, std::size_t slot, Copy copy) const = 0;
  // Starts bringing `piece`'s `copy` into `slot` (nothing to do in place: an empty, ready handle).
  virtual offload::IoHandle load(std::size_t piece, std::size_t slot, Copy copy) = 0;
  // Starts storing what data(piece, slot, copy) holds as `piece`'s `copy`. The slot belongs to the
  // transfer until the handle completes.
  virtual offload::IoHandle store(std::size_t piece, std::size_t slot, Copy copy) = 0;
  // Whether data() is the piece's lasting place (so a caller may read it after the next load of
  // the slot), rather than a staging slot.
  virtual bool in_place() const = 0;

  virtual std::size_t nvme_bytes() const = 0;    // of the store, both copies
  virtual std::size_t pinned_bytes() const = 0;  // the arrays or the slots

  // With two copies: `piece`'s spare copy becomes its current one (and the current one spare).
  // Throws Error with one copy.
  void promote(std::size_t piece) {
    require_spare("promote");
    spare_is_current_[piece] = !spare_is_current_[piece];
  }

 protected:
  Residency(std::size_t pieces, int copies);
  // Which of the two copies (0 or 1) `copy` names for `piece` now; Error for the spare of one copy.
  int index(std::size_t piece, Copy copy) const {
    if (copy == Copy::spare) require_spare("the spare copy");
    return static_cast<int>(spare_is_current_[piece]) ^ (copy == Copy::spare ? 1 : 0);
  }
  int copies() const { return copies_; }

 private:
  void require_spare(const char* what) const;

  const int copies_;
  std::vector<bool> spare_is_current_;  // per piece: copy 1 is the current one
};

class PinnedResidency final : public Residency {
 public:
  // One pinned array of `bytes` per copy (`copies`: 1 or 2), zeroed, counted as `purpose`; piece i
  // starts at byte offsets[i] of each.
  PinnedResidency(Device& device, HostPurpose purpose, std::size_t bytes, int copies, std::vector<std::size_t> offsets);

  char* data(std::size_t piece, std::size_t slot, Copy copy) const override;
  offload::IoHandle load(std::size_t, std::size_t, Copy) override { return {}; }
  offload::IoHandle store(std::size_t, std::size_t, Copy) override { return {}; }
  bool in_place() const override { return true; }
  std::size_t nvme_bytes() const override { return 0; }
  std::size_t pinned_bytes() const override;

 private:
  std::vector<std::size_t> offsets_;
  HostBuffer arrays_[2];
};

class NvmeResidency final : public Residency {
 public:
  // One region per piece and copy, named names[i] (".spare" added for the second copy), of
  // bytes[i] bytes (0: the piece has none and must not be used), in `store`; `slots` pinned staging
  // slots of `slot_bytes` each (store-aligned, holding the largest piece), counted as `purpose`.
  // Every piece's current copy starts as zeros, so each load finds data; the spare copy is read only
  // after a store wrote it. `owner` names the part in messages. Throws Error when the store's
  // alignment is not the memory plan's, IoError from the store, OutOfDeviceMemory/SystemError from
  // the pinned allocation.
  NvmeResidency(Device& device, HostPurpose purpose, std::shared_ptr<offload::Store> store, const std::string& owner,
                const std::vector<std::string>& names, std::span<const std::size_t> bytes, int copies,
                std::size_t slot_bytes, std::size_t slots);

  char* data(std::size_t piece, std::size_t slot, Copy copy) const override;
  offload::IoHandle load(std::size_t piece, std::size_t slot, Copy copy) override;
  offload::IoHandle store(std::size_t piece, std::size_t slot, Copy copy) override;
  bool in_place() const override { return false; }
  std::size_t nvme_bytes() const override;
  std::size_t pinned_bytes() const override { return slots_.bytes(); }

 private:
  offload::RegionId region(std::size_t piece, Copy copy) const {
    return regions_[piece * static_cast<std::size_t>(copies()) + static_cast<std::size_t>(index(piece, copy))];
  }

  std::shared_ptr<offload::Store> store_;
  std::size_t slot_bytes_ = 0;
  HostBuffer slots_;
  std::vector<offload::RegionId> regions_;  // per piece, per copy
  std::vector<bool> has_region_;            // per piece
};

// Waits for every transfer in `handles` and empties them, reporting nothing: for a failure path or
// a teardown, where the errors were already reported (or are about to be, by what failed).
void drain(std::span<offload::IoHandle> handles) noexcept;

}  // namespace zest::engine
