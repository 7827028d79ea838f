// PinnedResidency and NvmeResidency alone, on the cpu device. What it proves:
// - pinned: each piece is at its offset of a zeroed pinned array, used in place (load and store
//   move nothing, data() ignores the slot); two copies are distinct arrays, and promote() swaps
//   which one is current, per piece; the arrays are the pinned memory counted;
// - nvme: every piece's current copy starts as zeros in the swap file; what a store() writes from
//   a slot is in the file at the piece's region, byte for byte, and a load() into another slot
//   brings it back; the spare copy is a region of its own, which promote() makes the one load()
//   reads; a piece of 0 bytes has no region, and the regions are the swap bytes counted;
// - a spare copy never stored is not data: loading it raises IoError.
#include "engine/optimizer/residency.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/memory_plan.hpp"
#include "offload/nvme_store.hpp"
#include "offload/scratch_dir.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

TEST(PinnedResidency, PiecesLiveInPlaceAndPromoteSwapsTheirCopies) {
  auto device = make_cpu_device(std::size_t{16} << 20);
  {
    PinnedResidency pinned(*device, HostPurpose::param_shards, 4096, 2, {0, 1000, 3000});
    EXPECT_TRUE(pinned.in_place());
    EXPECT_EQ(pinned.pinned_bytes(), 2u * 4096);
    EXPECT_EQ(device->pinned_stats().current, 2u * 4096);
    EXPECT_EQ(pinned.nvme_bytes(), 0u);
    // Piece 1 is 1000 bytes after piece 0 in the same array; the slot does not matter.
    EXPECT_EQ(pinned.data(1, 0, Copy::current), pinned.data(0, 0, Copy::current) + 1000);
    EXPECT_EQ(pinned.data(2, 7, Copy::current), pinned.data(0, 0, Copy::current) + 3000);
    EXPECT_NE(pinned.data(1, 0, Copy::spare), pinned.data(1, 0, Copy::current));
    for (std::size_t i = 0; i < 4096; ++i) ASSERT_EQ(pinned.data(0, 0, Copy::current)[i], 0) << i;
    EXPECT_FALSE(pinned.load(1, 0, Copy::current));  // nothing to move: empty handles
    EXPECT_FALSE(pinned.store(1, 0, Copy::spare));

    std::memset(pinned.data(1, 0, Copy::spare), 7, 10);
    char* const old_current = pinned.data(1, 0, Copy::current);
    char* const other_piece = pinned.data(2, 0, Copy::current);
    pinned.promote(1);
    EXPECT_EQ(pinned.data(1, 0, Copy::current)[9], 7);
    EXPECT_EQ(pinned.data(1, 0, Copy::spare), old_current);
    EXPECT_EQ(pinned.data(2, 0, Copy::current), other_piece);  // only piece 1 changed copies
  }
  EXPECT_EQ(device->pinned_stats().current, 0u);
}

struct NvmeRig {
  NvmeRig() : device(make_cpu_device(std::size_t{16} << 20)) {
    offload::NvmeStoreOptions options;
    options.directories = {dir.path()};
    store = std::make_shared<offload::NvmeStore>(std::move(options));
  }
  // The bytes region `name` holds in the swap file (one directory: its offset in the store is its
  // offset in the file).
  std::vector<unsigned char> on_disk(const std::string& name, std::size_t bytes) const {
    return test::pread_file(store->path(), store->region(store->find(name)).offset, bytes);
  }

  test::ScratchDir dir;
  std::unique_ptr<Device> device;
  std::shared_ptr<offload::NvmeStore> store;
};

TEST(NvmeResidency, StoredBytesAreInTheSwapFileAndLoadBack) {
  NvmeRig rig;
  const std::vector<std::string> names = {"p.0", "p.1", "p.2"};
  const std::vector<std::size_t> bytes = {5000, 0, 3000};  // piece 1: none
  NvmeResidency nvme(*rig.device, HostPurpose::param_swap, rig.store, "test", names, bytes, 2, 8192, 3);
  EXPECT_FALSE(nvme.in_place());
  EXPECT_EQ(nvme.pinned_bytes(), 3u * 8192);
  EXPECT_EQ(rig.store->region_count(), 4u);  // two pieces, two copies each
  EXPECT_EQ(nvme.nvme_bytes(), 2 * (8192u + 4096u));
  EXPECT_EQ(nvme.nvme_bytes(), rig.store->used_bytes());
  EXPECT_EQ(nvme.data(0, 2, Copy::current), nvme.data(0, 0, Copy::current) + 2 * 8192);

  // Zeros at first.
  EXPECT_EQ(rig.on_disk("p.0", 5000), std::vector<unsigned char>(5000, 0));
  // A pattern stored from slot 1 is in the file, and loads back into slot 2.
  std::vector<unsigned char> pattern(5000);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 3);
  std::memcpy(nvme.data(0, 1, Copy::current), pattern.data(), pattern.size());
  nvme.store(0, 1, Copy::current).wait();
  EXPECT_EQ(rig.on_disk("p.0", 5000), pattern);
  nvme.load(0, 2, Copy::current).wait();
  EXPECT_EQ(std::memcmp(nvme.data(0, 2, Copy::current), pattern.data(), pattern.size()), 0);

  // The spare copy is its own region; promoted, it is what load() reads.
  std::memset(nvme.data(0, 0, Copy::spare), 0x5a, 5000);
  nvme.store(0, 0, Copy::spare).wait();
  EXPECT_EQ(rig.on_disk("p.0", 5000), pattern);  // the current copy is untouched
  EXPECT_EQ(rig.on_disk("p.0.spare", 5000), std::vector<unsigned char>(5000, 0x5a));
  nvme.promote(0);
  nvme.load(0, 2, Copy::current).wait();
  EXPECT_EQ(static_cast<unsigned char>(nvme.data(0, 2, Copy::current)[4999]), 0x5a);
  nvme.load(0, 2, Copy::spare).wait();
  EXPECT_EQ(std::memcmp(nvme.data(0, 2, Copy::spare), pattern.data(), pattern.size()), 0);
}

TEST(NvmeResidency, ASpareCopyNeverStoredIsNoData) {
  NvmeRig rig;
  NvmeResidency nvme(*rig.device, HostPurpose::optimizer_swap, rig.store, "test", {"only"},
                     std::vector<std::size_t>{100}, 2, 4096, 2);
  nvme.load(0, 0, Copy::current).wait();  // written with zeros at construction
  EXPECT_THROW(nvme.load(0, 1, Copy::spare).wait(), IoError);
}

}  // namespace
}  // namespace zest::engine
