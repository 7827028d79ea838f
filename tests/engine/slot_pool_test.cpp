// SlotPool alone, on the cpu device: a slot goes to one group at a time, a taker waits for the end
// of the slot's last use on the stream (so a buffer is never rewritten under a collective still
// reading it), and a pool with every slot taken refuses, saying how many there are and the remedy.
#include "engine/plan/slot_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

class SlotPoolTest : public testing::Test {
 protected:
  void SetUp() override {
    device_ = make_cpu_device(std::size_t{1} << 20);
    stream_ = device_->create_stream();
    for (int i = 0; i < 2; ++i) {
      Slot slot;
      slot.buffer = device_->allocate(256, MemoryCategory::buffers);
      slot.free_after = device_->create_event();
      stream_->record(*slot.free_after);
      pool_.add(std::move(slot));
    }
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  SlotPool pool_{"gradient bucket", "lower buckets.reduce"};
};

TEST_F(SlotPoolTest, ASlotBelongsToOneGroupUntilGivenBack) {
  const int a = pool_.take(3), b = pool_.take(4);
  EXPECT_NE(a, b);
  EXPECT_EQ(pool_[static_cast<std::size_t>(a)].owner, 3);
  EXPECT_EQ(pool_[static_cast<std::size_t>(b)].owner, 4);
  EXPECT_FALSE(pool_.any_free());
  try {
    pool_.take(5);
    ADD_FAILURE() << "a third group took one of two slots";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("every gradient bucket buffer is in use (2 of them)"), std::string::npos) << what;
    EXPECT_NE(what.find("lower buckets.reduce"), std::string::npos) << what;
  }
  pool_.give_back(a);
  EXPECT_TRUE(pool_.any_free());
  EXPECT_EQ(pool_.take(5), a);
}

TEST_F(SlotPoolTest, TheNextTakerWaitsForTheLastUseToEnd) {
  const int slot = pool_.take(0);
  pool_.take(1);  // the other slot stays taken: the next taker can only have the first
  std::atomic<bool> done{false};
  // The slot's last use: a collective still reading it on the stream, marked by its event.
  stream_->host_task([&done] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    done = true;
  });
  stream_->record(*pool_[static_cast<std::size_t>(slot)].free_after);
  pool_.give_back(slot);
  EXPECT_EQ(pool_.take(2), slot);
  EXPECT_TRUE(done.load()) << "the slot was taken while its last use still ran";
  stream_->synchronize();
}

}  // namespace
}  // namespace zest::engine
