// HostBufferPool: allocated once, leases are exclusive, acquire blocks until a lease comes back.
#include "runtime/device/host_buffer_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <set>
#include <thread>
#include <vector>

#include "tests/runtime/watchdog.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace std::chrono_literals;
using test::Watchdog;

TEST(HostBufferPool, AllocatesEveryBufferOnceUpFront) {
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 3, 10000);
  EXPECT_EQ(pool.count(), 3u);
  EXPECT_EQ(pool.buffer_bytes(), 10000u);
  EXPECT_EQ(pool.available(), 3u);
  EXPECT_EQ(device->pinned_stats().current, 30000u);
  for (int round = 0; round < 5; ++round) {
    auto lease = pool.acquire();
    std::memset(lease.data(), round, lease.bytes());
  }
  const HostMemoryStats stats = device->pinned_stats();
  EXPECT_EQ(stats.current, 30000u);  // leasing allocates nothing
  EXPECT_EQ(stats.peak, 30000u);
}

TEST(HostBufferPool, LeasesAreDistinctBuffersWithDistinctIndices) {
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 4, 64);
  std::vector<HostBufferPool::Lease> leases;
  std::set<void*> data;
  std::set<std::size_t> indices;
  for (int i = 0; i < 4; ++i) {
    leases.push_back(pool.acquire());
    ASSERT_TRUE(leases.back());
    EXPECT_EQ(leases.back().bytes(), 64u);
    data.insert(leases.back().data());
    indices.insert(leases.back().index());
  }
  EXPECT_EQ(data.size(), 4u);
  EXPECT_EQ(indices, (std::set<std::size_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.available(), 0u);
  EXPECT_FALSE(pool.try_acquire());
  leases.clear();
  EXPECT_EQ(pool.available(), 4u);
}

TEST(HostBufferPool, TryAcquireGivesAnEmptyLeaseWhenExhausted) {
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 1, 64);
  auto held = pool.try_acquire();
  ASSERT_TRUE(held);
  EXPECT_FALSE(pool.try_acquire());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(pool.try_acquire_for(20ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
  held.reset();
  EXPECT_FALSE(held);
  EXPECT_TRUE(pool.try_acquire());
}

TEST(HostBufferPool, AcquireBlocksUntilALeaseIsReturned) {
  Watchdog dog;
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 2, 64);
  auto first = pool.acquire();
  auto second = pool.acquire();
  const std::size_t returned_index = second.index();

  std::atomic<bool> acquired{false};
  auto waiter = std::async(std::launch::async, [&] {
    auto lease = pool.acquire();
    acquired = true;
    return lease.index();
  });
  // The waiter must still be blocked while both buffers are leased.
  EXPECT_EQ(waiter.wait_for(50ms), std::future_status::timeout);
  EXPECT_FALSE(acquired.load());
  second.reset();
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready) << "acquire() missed the return";
  EXPECT_EQ(waiter.get(), returned_index);
  EXPECT_EQ(pool.available(), 1u);  // the waiter's lease went back when its scope ended
}

TEST(HostBufferPool, MovingALeaseReturnsTheBufferOnlyOnce) {
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 2, 64);
  auto a = pool.acquire();
  HostBufferPool::Lease b(std::move(a));
  EXPECT_FALSE(a);
  EXPECT_EQ(pool.available(), 1u);
  auto c = pool.acquire();
  c = std::move(b);  // c's own buffer goes back; b's is now held by c
  EXPECT_EQ(pool.available(), 1u);
  a.reset();
  b.reset();
  EXPECT_EQ(pool.available(), 1u);
  c.reset();
  EXPECT_EQ(pool.available(), 2u);
}

TEST(HostBufferPool, ALeaseMayBeReturnedFromAStreamWorker) {
  Watchdog dog;
  auto device = make_cpu_device(4096);
  HostBufferPool pool(*device, 1, 64);
  auto stream = device->create_stream();
  auto lease = std::make_shared<HostBufferPool::Lease>(pool.acquire());
  device->memset_async(lease->data(), 9, lease->bytes(), *stream);
  stream->host_task([lease] { lease->reset(); });  // gives it back once the memset is done
  lease.reset();
  auto again = pool.acquire();  // blocks until the worker returned it
  EXPECT_EQ(again.as<unsigned char>()[63], 9);
  stream->synchronize();
}

TEST(HostBufferPool, EmptyPoolIsRejected) {
  auto device = make_cpu_device(4096);
  EXPECT_THROW(HostBufferPool(*device, 0, 64), Error);
  try {
    HostBufferPool pool(*device, 2, 0);
    FAIL() << "expected zest::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("buffer_count"), std::string::npos) << e.what();
  }
  EXPECT_EQ(device->pinned_stats().current, 0u);
}

}  // namespace
}  // namespace zest
