// The cpu Device: budget accounting, OutOfDeviceMemory, RAII buffers, async copy/memset on the
// stream workers, device-wide synchronize, pinned memory counted apart.
#include "runtime/device/cpu_device.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <latch>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tests/runtime/watchdog.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace std::chrono_literals;
using test::Watchdog;

constexpr MemoryCategory kParams = MemoryCategory::params;
constexpr MemoryCategory kGrads = MemoryCategory::grads;
constexpr MemoryCategory kStates = MemoryCategory::optimizer_states;
constexpr MemoryCategory kBuffers = MemoryCategory::buffers;

bool same_figures(const MemoryStats& a, const MemoryStats& b) {
  return a.budget == b.budget && a.current == b.current && a.peak == b.peak &&
         a.current_total == b.current_total && a.peak_total == b.peak_total;
}

TEST(CpuDevice, DescribesItself) {
  auto device = make_cpu_device(1 << 20);
  EXPECT_EQ(device->type(), DeviceType::cpu);
  EXPECT_EQ(device->name(), "cpu");
  EXPECT_TRUE(device->host_accessible());
  EXPECT_EQ(device->memory_stats().budget, std::size_t{1} << 20);
  EXPECT_EQ(category_name(kParams), "params");
  EXPECT_EQ(category_name(kGrads), "grads");
  EXPECT_EQ(category_name(kStates), "optimizer_states");
  EXPECT_EQ(category_name(kBuffers), "buffers");
}

TEST(CpuDevice, ZeroBudgetIsRejected) {
  try {
    make_cpu_device(0);
    FAIL() << "expected zest::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device.memory"), std::string::npos) << e.what();
  }
}

TEST(CpuDevice, AllocationsAreAlignedWritableAndCountedByCategory) {
  auto device = make_cpu_device(1 << 20);
  DeviceBuffer params = device->allocate(1000, kParams);
  DeviceBuffer grads = device->allocate(3, kGrads);
  DeviceBuffer states = device->allocate(777, kStates);
  for (const DeviceBuffer* b : {&params, &grads, &states}) {
    ASSERT_TRUE(*b);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 256, 0u);
    std::memset(b->data(), 0xab, b->bytes());
  }
  EXPECT_EQ(params.bytes(), 1000u);
  EXPECT_EQ(params.category(), kParams);

  const MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.current_of(kParams), 1000u);
  EXPECT_EQ(stats.current_of(kGrads), 3u);
  EXPECT_EQ(stats.current_of(kStates), 777u);
  EXPECT_EQ(stats.current_of(kBuffers), 0u);
  EXPECT_EQ(stats.current_total, 1780u);
  EXPECT_EQ(stats.peak_total, 1780u);
  EXPECT_EQ(stats.driver_free, 0u);
  EXPECT_EQ(stats.driver_total, 0u);
}

TEST(CpuDevice, PeakOfTotalIsNotTheSumOfPeaks) {
  auto device = make_cpu_device(1 << 20);
  { DeviceBuffer params = device->allocate(1000, kParams); }
  DeviceBuffer grads = device->allocate(2000, kGrads);
  const MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.current_of(kParams), 0u);
  EXPECT_EQ(stats.peak_of(kParams), 1000u);
  EXPECT_EQ(stats.current_of(kGrads), 2000u);
  EXPECT_EQ(stats.peak_of(kGrads), 2000u);
  EXPECT_EQ(stats.current_total, 2000u);
  EXPECT_EQ(stats.peak_total, 2000u);  // the two never lived together: not 3000
}

TEST(CpuDevice, ResetPeakRestartsPeaksFromCurrentFigures) {
  auto device = make_cpu_device(1 << 20);
  DeviceBuffer kept = device->allocate(100, kParams);
  { DeviceBuffer temporary = device->allocate(5000, kBuffers); }
  ASSERT_EQ(device->memory_stats().peak_total, 5100u);
  device->reset_peak();
  MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.peak_total, 100u);
  EXPECT_EQ(stats.peak_of(kParams), 100u);
  EXPECT_EQ(stats.peak_of(kBuffers), 0u);
  DeviceBuffer later = device->allocate(50, kBuffers);
  stats = device->memory_stats();
  EXPECT_EQ(stats.peak_total, 150u);
  EXPECT_EQ(stats.peak_of(kBuffers), 50u);
}

TEST(CpuDevice, BuffersUncountOnDestructionMoveAndMoveAssign) {
  auto device = make_cpu_device(1 << 20);
  DeviceBuffer a = device->allocate(100, kParams);
  DeviceBuffer b = device->allocate(200, kGrads);
  void* b_data = b.data();
  a = std::move(b);  // frees a's 100 bytes, takes b's 200
  MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.current_of(kParams), 0u);
  EXPECT_EQ(stats.current_of(kGrads), 200u);
  EXPECT_EQ(stats.current_total, 200u);
  EXPECT_FALSE(b);
  EXPECT_EQ(b.bytes(), 0u);
  EXPECT_EQ(a.data(), b_data);
  EXPECT_EQ(a.category(), kGrads);

  DeviceBuffer c(std::move(a));  // moving does not count twice
  EXPECT_EQ(device->memory_stats().current_total, 200u);
  // Self-move-assign must not free; through references, since GCC 13 rejects the spelled-out
  // `a = std::move(a)` (-Wself-move).
  DeviceBuffer& also_a = a;
  DeviceBuffer& also_c = c;
  a = std::move(also_a);
  c = std::move(also_c);
  EXPECT_EQ(device->memory_stats().current_total, 200u);
  c = DeviceBuffer();
  EXPECT_EQ(device->memory_stats().current_total, 0u);
}

TEST(CpuDevice, ZeroByteAllocationIsEmptyAndUncounted) {
  auto device = make_cpu_device(1024);
  DeviceBuffer empty = device->allocate(0, kParams);
  EXPECT_FALSE(empty);
  EXPECT_EQ(device->memory_stats().current_total, 0u);
  HostBuffer host = device->allocate_pinned(0);
  EXPECT_FALSE(host);
  EXPECT_EQ(device->pinned_stats().current, 0u);
}

TEST(CpuDevice, AllocationExactlyAtTheBudgetSucceeds) {
  auto device = make_cpu_device(4096);
  DeviceBuffer a = device->allocate(4000, kParams);
  DeviceBuffer b = device->allocate(96, kGrads);
  EXPECT_EQ(device->memory_stats().current_total, 4096u);
  EXPECT_THROW(device->allocate(1, kBuffers), OutOfDeviceMemory);
}

TEST(CpuDevice, AllocationPastTheBudgetThrowsAndCountsNothing) {
  constexpr std::size_t kBudget = std::size_t{1} << 20;  // 1 MiB
  auto device = make_cpu_device(kBudget);
  DeviceBuffer params = device->allocate(600 << 10, kParams);  // 600 KiB
  DeviceBuffer buffers = device->allocate(100 << 10, kBuffers);
  DeviceBuffer grads = device->allocate(200 << 10, kGrads);
  const MemoryStats before = device->memory_stats();

  constexpr std::size_t kRequest = std::size_t{300} << 10;
  try {
    device->allocate(kRequest, kStates);
    FAIL() << "expected OutOfDeviceMemory";
  } catch (const OutOfDeviceMemory& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.requested(), kRequest);
    EXPECT_EQ(e.budget(), kBudget);
    // The budget, the request, what is in use and for what, and what to do.
    EXPECT_NE(message.find("1.00 MiB (1048576 bytes)"), std::string::npos) << message;
    EXPECT_NE(message.find("300.00 KiB (307200 bytes)"), std::string::npos) << message;
    EXPECT_NE(message.find("for optimizer_states"), std::string::npos) << message;
    EXPECT_NE(message.find("in use 900.00 KiB (921600 bytes)"), std::string::npos) << message;
    // Largest first.
    const auto at_params = message.find("params 600.00 KiB");
    const auto at_grads = message.find("grads 200.00 KiB");
    const auto at_buffers = message.find("buffers 100.00 KiB");
    ASSERT_NE(at_params, std::string::npos) << message;
    ASSERT_NE(at_grads, std::string::npos) << message;
    ASSERT_NE(at_buffers, std::string::npos) << message;
    EXPECT_LT(at_params, at_grads);
    EXPECT_LT(at_grads, at_buffers);
    EXPECT_NE(message.find("device.memory"), std::string::npos) << message;
    EXPECT_NE(message.find("stage"), std::string::npos) << message;
    EXPECT_NE(message.find("offload"), std::string::npos) << message;
  }
  EXPECT_TRUE(same_figures(device->memory_stats(), before));
}

TEST(CpuDevice, HugeRequestThrowsInsteadOfWrappingTheCount) {
  auto device = make_cpu_device(4096);
  DeviceBuffer held = device->allocate(100, kParams);
  EXPECT_THROW(device->allocate(std::numeric_limits<std::size_t>::max() - 50, kParams),
               OutOfDeviceMemory);
  EXPECT_EQ(device->memory_stats().current_total, 100u);
}

TEST(CpuDevice, ConcurrentAllocationsKeepExactCounts) {
  auto device = make_cpu_device(std::size_t{64} << 20);
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const auto category = static_cast<MemoryCategory>(t % 4);
      for (int i = 0; i < kRounds; ++i) {
        DeviceBuffer a = device->allocate(1000, category);
        DeviceBuffer b = device->allocate(24, category);
        (void)device->memory_stats();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.current_total, 0u);
  EXPECT_LE(stats.peak_total, std::size_t{kThreads} * 1024);
  EXPECT_GE(stats.peak_total, 1024u);
  for (std::size_t c = 0; c < kMemoryCategoryCount; ++c) EXPECT_EQ(stats.peak[c], 1024u);
}

TEST(CpuDevice, MemsetAndCopyProduceTheExpectedBytes) {
  auto device = make_cpu_device(1 << 20);
  auto stream = device->create_stream();
  constexpr std::size_t kBytes = 4099;
  DeviceBuffer a = device->allocate(kBytes, kBuffers);
  DeviceBuffer b = device->allocate(kBytes, kBuffers);
  std::vector<unsigned char> host(kBytes);
  for (std::size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);
  std::vector<unsigned char> back(kBytes, 0);

  device->memset_async(a.data(), 0x5a, kBytes, *stream);
  device->copy_async(back.data(), a.data(), kBytes, *stream);  // device -> host
  stream->synchronize();
  for (std::size_t i = 0; i < kBytes; ++i) ASSERT_EQ(back[i], 0x5a) << i;

  device->copy_async(a.data(), host.data(), kBytes, *stream);            // host -> device
  device->copy_async(b.data(), a.data(), kBytes, *stream);               // device -> device
  device->memset_async(b.as<unsigned char>() + 10, 0, 5, *stream);       // a sub-range
  device->copy_async(back.data(), b.data(), kBytes, *stream);            // device -> host
  stream->synchronize();
  for (std::size_t i = 0; i < kBytes; ++i) {
    const unsigned char expected = (i >= 10 && i < 15) ? 0 : host[i];
    ASSERT_EQ(back[i], expected) << i;
  }
}

TEST(CpuDevice, CopyRunsOnTheStreamWorkerInStreamOrder) {
  Watchdog dog;
  auto device = make_cpu_device(1 << 20);
  auto stream = device->create_stream();
  DeviceBuffer buffer = device->allocate(64, kBuffers);
  std::memset(buffer.data(), 1, 64);
  std::vector<unsigned char> host(64, 0);
  std::latch gate(1);
  stream->host_task([&] { gate.wait(); });
  device->copy_async(host.data(), buffer.data(), 64, *stream);
  // Queued behind the blocked task: not done yet, and the call returned.
  std::this_thread::sleep_for(10ms);
  EXPECT_EQ(host[0], 0);
  gate.count_down();
  stream->synchronize();
  EXPECT_EQ(host[0], 1);
  EXPECT_EQ(host[63], 1);
}

TEST(CpuDevice, EventsFromTheDeviceOrderCopiesAcrossStreams) {
  Watchdog dog;
  auto device = make_cpu_device(1 << 20);
  auto compute = device->create_stream();
  auto transfer = device->create_stream();
  auto ready = device->create_event();
  DeviceBuffer buffer = device->allocate(256, kGrads);
  std::vector<unsigned char> host(256, 0);
  std::latch gate(1);
  compute->host_task([&] { gate.wait(); });
  device->memset_async(buffer.data(), 7, 256, *compute);
  compute->record(*ready);
  transfer->wait(*ready);
  device->copy_async(host.data(), buffer.data(), 256, *transfer);
  gate.count_down();
  transfer->synchronize();
  for (unsigned char byte : host) ASSERT_EQ(byte, 7);
}

TEST(CpuDevice, SynchronizeDrainsEveryStreamAndReportsErrors) {
  Watchdog dog;
  auto device = make_cpu_device(1 << 20);
  auto a = device->create_stream();
  auto b = device->create_stream();
  std::atomic<int> done{0};
  for (auto* stream : {a.get(), b.get()}) {
    stream->host_task([&] {
      std::this_thread::sleep_for(20ms);
      ++done;
    });
  }
  { auto destroyed = device->create_stream(); destroyed->host_task([&] { ++done; }); }
  EXPECT_EQ(done.load(), 1);  // the destroyed stream drained before it went away
  device->synchronize();
  EXPECT_EQ(done.load(), 3);

  b->host_task([] { throw std::runtime_error("task on b failed"); });
  try {
    device->synchronize();
    FAIL() << "expected the task's error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task on b failed");
  }
  device->synchronize();  // reported once
}

TEST(CpuDevice, RejectsStreamsOfAnotherDevice) {
  auto device = make_cpu_device(1 << 20);
  auto other = make_cpu_device(1 << 20);
  auto foreign = other->create_stream();
  char src[4] = {1, 2, 3, 4};
  char dst[4] = {};
  try {
    device->copy_async(dst, src, 4, *foreign);
    FAIL() << "expected zest::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not created by this device"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(device->memset_async(dst, 0, 4, *foreign), Error);
}

TEST(CpuDevice, PinnedMemoryIsPageAlignedPrefaultedAndCountedApart) {
  auto device = make_cpu_device(4096);  // the device budget does not limit pinned memory
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  {
    HostBuffer staging = device->allocate_pinned(3 * page + 10);
    ASSERT_TRUE(staging);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(staging.data()) % page, 0u);
    EXPECT_EQ(staging.bytes(), 3 * page + 10);
    // Anonymous memory starts zeroed, and pre-faulting must not have changed that.
    for (std::size_t i = 0; i < staging.bytes(); i += 512) ASSERT_EQ(staging.as<char>()[i], 0);
    std::memset(staging.data(), 0x33, staging.bytes());

    HostMemoryStats pinned = device->pinned_stats();
    EXPECT_EQ(pinned.current, 3 * page + 10);
    EXPECT_EQ(pinned.peak, 3 * page + 10);
    EXPECT_EQ(pinned.locked, staging.locked() ? staging.bytes() : 0u);
    EXPECT_EQ(device->memory_stats().current_total, 0u);

    HostBuffer moved = std::move(staging);
    EXPECT_FALSE(staging);
    EXPECT_EQ(device->pinned_stats().current, 3 * page + 10);
    DeviceBuffer on_device = device->allocate(100, kBuffers);
    EXPECT_EQ(device->memory_stats().current_total, 100u);
    EXPECT_EQ(device->pinned_stats().current, 3 * page + 10);
  }
  HostMemoryStats pinned = device->pinned_stats();
  EXPECT_EQ(pinned.current, 0u);
  EXPECT_EQ(pinned.locked, 0u);
  EXPECT_EQ(pinned.peak, 3 * page + 10);
  device->reset_peak();
  EXPECT_EQ(device->pinned_stats().peak, 0u);
}

TEST(CpuDevice, PinnedMoveAssignReleasesTheOldBlock) {
  auto device = make_cpu_device(4096);
  HostBuffer a = device->allocate_pinned(1000);
  HostBuffer b = device->allocate_pinned(5000);
  EXPECT_EQ(device->pinned_stats().current, 6000u);
  a = std::move(b);
  EXPECT_EQ(device->pinned_stats().current, 5000u);
  EXPECT_EQ(a.bytes(), 5000u);
  a = HostBuffer();
  EXPECT_EQ(device->pinned_stats().current, 0u);
}

// The device counts pinned memory by the caller's labels without knowing them: an enumeration
// that says it is a label (below HostLabel::kCount), unlabelled blocks under the last one, and a
// label out of range is refused before anything is allocated.
enum class TrainerLabel : unsigned char { activations = 2, data = 5, past_the_end = HostLabel::kCount };
enum class NotALabel { a };
}  // namespace
template <>
inline constexpr bool is_host_label<TrainerLabel> = true;
namespace {
static_assert(std::is_convertible_v<TrainerLabel, HostLabel>);
static_assert(!std::is_convertible_v<NotALabel, HostLabel>, "an enumeration must opt in to label memory");
static_assert(!std::is_convertible_v<MemoryCategory, HostLabel>, "device categories are not host labels");

TEST(CpuDevice, PinnedMemoryIsCountedByTheCallersLabels) {
  auto device = make_cpu_device(4096);
  HostBuffer a = device->allocate_pinned(1000, TrainerLabel::activations);
  HostBuffer b = device->allocate_pinned(3000, TrainerLabel::data);
  HostBuffer c = device->allocate_pinned(500);
  const HostMemoryStats stats = device->pinned_stats();
  EXPECT_EQ(stats.current_of(TrainerLabel::activations), 1000u);
  EXPECT_EQ(stats.current_of(TrainerLabel::data), 3000u);
  EXPECT_EQ(stats.current_of(HostLabel::unlabelled()), 500u);
  EXPECT_EQ(stats.current, 4500u);
  EXPECT_EQ(b.label().index(), 5u);
  b = HostBuffer();
  EXPECT_EQ(device->pinned_stats().current_of(TrainerLabel::data), 0u);
  EXPECT_EQ(device->pinned_stats().peak_of(TrainerLabel::data), 3000u);
  try {
    static_cast<void>(device->allocate_pinned(100, TrainerLabel::past_the_end));
    ADD_FAILURE() << "a label past HostLabel::kCount was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("pinned memory label 8 is not below HostLabel::kCount (8)"),
              std::string::npos)
        << error.what();
  }
  EXPECT_EQ(device->pinned_stats().current, 1500u);
}

}  // namespace
}  // namespace zest
