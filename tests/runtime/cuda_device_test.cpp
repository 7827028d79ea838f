// The cuda Device: memory counted and budgeted as on the cpu backend, the caching allocator reusing
// blocks and emptying itself when the GPU runs out, streams and events ordering real work, host
// task errors reaching the host, pinned memory, and the cast kernel bit-exact against the host
// conversions. GPU tests skip, saying so, where no GPU is visible; the cache policy and the
// backend checks run everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cast.hpp"
#include "runtime/device/block_cache.hpp"
#include "runtime/device/cuda_device.hpp"
#include "runtime/host/half.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

#define SKIP_WITHOUT_GPU()                                                                  \
  if (!cuda_device_available())                                                             \
  GTEST_SKIP() << "no CUDA GPU: cudaGetDeviceCount finds none, so the cuda Device is not run"

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::size_t driver_total_memory() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  return total_bytes;
}

// --- the cache policy (no GPU needed)

TEST(BlockCache, RoundsToAFractionOfTheSizeWithinBounds) {
  EXPECT_EQ(BlockCache::rounded_size(0), 512u);
  EXPECT_EQ(BlockCache::rounded_size(1), 512u);
  EXPECT_EQ(BlockCache::rounded_size(512), 512u);
  EXPECT_EQ(BlockCache::rounded_size(513), 1024u);
  EXPECT_EQ(BlockCache::rounded_size(kMiB), kMiB);
  EXPECT_EQ(BlockCache::rounded_size(kMiB + 1), kMiB + 64 * kKiB);
  EXPECT_EQ(BlockCache::rounded_size(kMiB - 100), kMiB);
  EXPECT_EQ(BlockCache::rounded_size(std::size_t{1} << 30), std::size_t{1} << 30);
  EXPECT_EQ(BlockCache::rounded_size((std::size_t{1} << 30) + 1), (std::size_t{1} << 30) + 2 * kMiB);
  constexpr std::size_t huge = std::numeric_limits<std::size_t>::max() - 5;
  EXPECT_EQ(BlockCache::rounded_size(huge), huge);  // left for the allocator to refuse
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const std::size_t bytes = (rng() >> (rng() % 60)) + 1;
    const std::size_t rounded = BlockCache::rounded_size(bytes);
    ASSERT_GE(rounded, bytes);
    ASSERT_EQ(rounded % 512, 0u) << bytes;
    // At most 1/16 of the request and at most 2 MiB is wasted (beyond the 512-byte minimum).
    ASSERT_LE(rounded - bytes, std::max<std::size_t>(511, std::min(bytes / 16, 2 * kMiB))) << bytes;
    ASSERT_EQ(BlockCache::rounded_size(rounded), rounded) << bytes;
  }
}

TEST(BlockCache, HandsBackBlocksOfTheSameRoundedSizeOnly) {
  BlockCache cache;
  int a = 0, b = 0, c = 0;
  EXPECT_EQ(cache.take(512), nullptr);
  cache.put(&a, 512);
  cache.put(&b, 512);
  cache.put(&c, 4096);
  EXPECT_EQ(cache.cached_bytes(), 512u + 512u + 4096u);
  EXPECT_EQ(cache.cached_blocks(), 3u);
  EXPECT_EQ(cache.take(1024), nullptr);
  void* first = cache.take(512);
  void* second = cache.take(512);
  EXPECT_TRUE((first == &a && second == &b) || (first == &b && second == &a));
  EXPECT_EQ(cache.take(512), nullptr);
  EXPECT_EQ(cache.cached_bytes(), 4096u);
  std::vector<std::pair<void*, std::size_t>> released;
  cache.put(&a, 512);
  cache.drain([&](void* block, std::size_t bytes) { released.emplace_back(block, bytes); });
  EXPECT_EQ(released.size(), 2u);
  EXPECT_EQ(cache.cached_bytes(), 0u);
  EXPECT_EQ(cache.cached_blocks(), 0u);
  EXPECT_EQ(cache.take(4096), nullptr);
}

// --- backend checks (no GPU needed)

TEST(CudaDevice, CpuStreamsAndDevicesAreNotCuda) {
  auto cpu = make_cpu_device(kMiB);
  auto stream = cpu->create_stream();
  EXPECT_EQ(cuda_device_ordinal(*cpu), -1);
  try {
    static_cast<void>(cuda_stream_handle(*stream));
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_TRUE(contains(error.what(), "not a CUDA stream")) << error.what();
  }
}

TEST(CudaDevice, WithoutAGpuMakingOneSaysWhy) {
  if (cuda_device_available()) GTEST_SKIP() << "a CUDA GPU is visible: nothing to refuse";
  try {
    static_cast<void>(make_cuda_device(0, 0));
    FAIL() << "no SystemError";
  } catch (const SystemError& error) {
    EXPECT_TRUE(contains(error.what(), "no CUDA GPU is visible")) << error.what();
    EXPECT_TRUE(contains(error.what(), "device.type: cpu")) << error.what();
  }
}

// --- the device on a GPU

TEST(CudaDevice, IdentityAndDefaultBudgetComeFromTheGpu) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  EXPECT_EQ(device->type(), DeviceType::cuda);
  EXPECT_FALSE(device->host_accessible());
  cudaDeviceProp properties{};
  ASSERT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  EXPECT_EQ(device->name(), std::string("cuda:0 (") + properties.name + ")");
  EXPECT_EQ(cuda_device_ordinal(*device), 0);
  const MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.budget, properties.totalGlobalMem);
  EXPECT_EQ(stats.driver_total, driver_total_memory());
  EXPECT_GT(stats.driver_free, 0u);
  EXPECT_LE(stats.driver_free, stats.driver_total);
  EXPECT_EQ(stats.current_total, 0u);
}

TEST(CudaDevice, OrdinalWrapsAroundTheVisibleGpus) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  auto device = make_cuda_device(count, 0);
  EXPECT_EQ(cuda_device_ordinal(*device), 0);
  EXPECT_TRUE(device->name().starts_with("cuda:0 ")) << device->name();
  try {
    static_cast<void>(make_cuda_device(-1, 0));
    FAIL() << "no SystemError";
  } catch (const SystemError& error) {
    EXPECT_TRUE(contains(error.what(), "ordinal -1 is negative")) << error.what();
  }
}

TEST(CudaDevice, AllocationsAreCountedByCategoryAndAreGpuMemory) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  {
    DeviceBuffer params = device->allocate(1000, MemoryCategory::params);
    DeviceBuffer grads = device->allocate(3000, MemoryCategory::grads);
    DeviceBuffer states = device->allocate(256, MemoryCategory::optimizer_states);
    MemoryStats stats = device->memory_stats();
    EXPECT_EQ(stats.current_of(MemoryCategory::params), 1000u);
    EXPECT_EQ(stats.current_of(MemoryCategory::grads), 3000u);
    EXPECT_EQ(stats.current_of(MemoryCategory::optimizer_states), 256u);
    EXPECT_EQ(stats.current_of(MemoryCategory::buffers), 0u);
    EXPECT_EQ(stats.current_total, 4256u);
    for (const DeviceBuffer* buffer : {&params, &grads, &states}) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer->data()) % 256, 0u);
      cudaPointerAttributes attributes{};
      ASSERT_EQ(cudaPointerGetAttributes(&attributes, buffer->data()), cudaSuccess);
      EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
      EXPECT_EQ(attributes.device, 0);
    }
    EXPECT_NE(params.data(), grads.data());
    grads = DeviceBuffer();
    stats = device->memory_stats();
    EXPECT_EQ(stats.current_of(MemoryCategory::grads), 0u);
    EXPECT_EQ(stats.peak_of(MemoryCategory::grads), 3000u);
    EXPECT_EQ(stats.current_total, 1256u);
    EXPECT_EQ(stats.peak_total, 4256u);
  }
  EXPECT_EQ(device->memory_stats().current_total, 0u);
}

TEST(CudaDevice, BudgetIsEnforcedBeforeTheDriverIsAsked) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, kMiB);
  DeviceBuffer held = device->allocate(768 * kKiB, MemoryCategory::params);
  try {
    static_cast<void>(device->allocate(512 * kKiB, MemoryCategory::buffers));
    FAIL() << "no OutOfDeviceMemory";
  } catch (const OutOfDeviceMemory& error) {
    EXPECT_EQ(error.requested(), 512 * kKiB);
    EXPECT_EQ(error.budget(), kMiB);
    EXPECT_TRUE(contains(error.what(), "1048576")) << error.what();
  }
  // The failed request counted nothing.
  EXPECT_EQ(device->memory_stats().current_total, 768 * kKiB);
  EXPECT_NO_THROW(static_cast<void>(device->allocate(256 * kKiB, MemoryCategory::buffers)));
}

TEST(CudaDevice, DriverOutOfMemoryBecomesOutOfDeviceMemory) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, std::numeric_limits<std::size_t>::max() / 4);
  const std::size_t too_much = 2 * driver_total_memory();
  try {
    static_cast<void>(device->allocate(too_much, MemoryCategory::params));
    FAIL() << "no OutOfDeviceMemory";
  } catch (const OutOfDeviceMemory& error) {
    EXPECT_EQ(error.requested(), too_much);
    EXPECT_TRUE(contains(error.what(), device->name())) << error.what();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed cudaMalloc left its error behind";
  EXPECT_EQ(device->memory_stats().current_total, 0u);
  EXPECT_NO_THROW(static_cast<void>(device->allocate(kMiB, MemoryCategory::params)));
}

TEST(CudaDevice, FreedBlocksAreReusedWithoutTheDriver) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  void* first = nullptr;
  {
    DeviceBuffer buffer = device->allocate(kMiB, MemoryCategory::buffers);
    first = buffer.data();
  }
  const std::size_t free_before = device->memory_stats().driver_free;
  // A slightly smaller request falls in the same bin: the same block, no cudaMalloc.
  DeviceBuffer again = device->allocate(kMiB - 100, MemoryCategory::params);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(device->memory_stats().driver_free, free_before);
  EXPECT_EQ(device->memory_stats().current_of(MemoryCategory::params), kMiB - 100);
  // A block in use is never handed out twice.
  DeviceBuffer other = device->allocate(kMiB, MemoryCategory::params);
  EXPECT_NE(other.data(), first);
}

TEST(CudaDevice, CacheIsEmptiedWhenTheGpuRunsOut) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  const std::size_t free_bytes = device->memory_stats().driver_free;
  const std::size_t first_size = free_bytes / 10 * 6;
  const std::size_t second_size = free_bytes / 10 * 7;
  { DeviceBuffer first = device->allocate(first_size, MemoryCategory::buffers); }
  // 60% of the GPU sits in the cache; 70% more only fits once the cache goes back to the driver.
  EXPECT_LT(device->memory_stats().driver_free, free_bytes - first_size / 2);
  DeviceBuffer second;
  ASSERT_NO_THROW(second = device->allocate(second_size, MemoryCategory::buffers));
  EXPECT_EQ(device->memory_stats().current_total, second_size);
}

// A program's allocator (zest::torch gives torch's caching allocator): every device byte comes
// from it and goes back to it, still counted by category and held to the budget by the Device.
class CountingSource final : public DeviceMemorySource {
 public:
  void* allocate(std::size_t bytes) override {
    void* data = nullptr;
    if (cudaMalloc(&data, bytes) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return nullptr;
    }
    held += bytes;
    return data;
  }
  void free(void* data, std::size_t bytes) noexcept override {
    static_cast<void>(cudaFree(data));
    held -= bytes;
  }
  std::size_t held = 0;
};

TEST(CudaDevice, AProgramsAllocatorGivesEveryByte) {
  SKIP_WITHOUT_GPU();
  auto source = std::make_shared<CountingSource>();
  auto device = make_cuda_device(0, 4 * kMiB, {}, source);
  {
    DeviceBuffer params = device->allocate(kMiB, MemoryCategory::params);
    DeviceBuffer buffers = device->allocate(kMiB + 7, MemoryCategory::buffers);
    EXPECT_EQ(source->held, 2 * kMiB + 7);  // exact sizes: the program's allocator rounds, not zest
    EXPECT_EQ(device->memory_stats().current_of(MemoryCategory::params), kMiB);
    EXPECT_THROW(static_cast<void>(device->allocate(3 * kMiB, MemoryCategory::params)), OutOfDeviceMemory);
  }
  EXPECT_EQ(source->held, 0u);  // no cache of zest's keeps anything back
  const auto huge = make_cuda_device(0, std::numeric_limits<std::size_t>::max() / 4, {}, source);
  EXPECT_THROW(static_cast<void>(huge->allocate(2 * driver_total_memory(), MemoryCategory::params)), OutOfDeviceMemory);
}

// A program's stream (torch's current stream) is borrowed, ordered against zest's with events, and
// left alive when the borrowed Stream goes.
TEST(CudaDevice, ABorrowedStreamOrdersWorkAndStaysThePrograms) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  EXPECT_THROW(static_cast<void>(device->borrow_stream(nullptr)), Error);
  cudaStream_t program = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&program, cudaStreamNonBlocking), cudaSuccess);
  constexpr std::size_t n = 1 << 22;
  DeviceBuffer buffer = device->allocate(n, MemoryCategory::buffers);
  std::vector<unsigned char> host(n, 0);
  {
    auto borrowed = device->borrow_stream(program);
    auto zest_stream = device->create_stream();
    auto written = device->create_event();
    // The program's stream writes 0x5a only once the host opens its gate; zest's stream copies
    // after the event, so it must see 0x5a, never the zeros before.
    ASSERT_EQ(cudaMemset(buffer.data(), 0, n), cudaSuccess);
    std::atomic<bool> open{false};
    ASSERT_EQ(cudaLaunchHostFunc(
                  program,
                  [](void* gate) {
                    while (!static_cast<std::atomic<bool>*>(gate)->load())
                      std::this_thread::sleep_for(std::chrono::milliseconds(1));
                  },
                  &open),
              cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(buffer.data(), 0x5a, n, program), cudaSuccess);
    borrowed->record(*written);
    zest_stream->wait(*written);
    device->copy_async(host.data(), buffer.data(), n, *zest_stream);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    open = true;
    zest_stream->synchronize();
  }
  EXPECT_EQ(host, std::vector<unsigned char>(n, 0x5a));
  EXPECT_EQ(cudaStreamQuery(program), cudaSuccess) << "the program's stream did not survive its borrowing";
  EXPECT_EQ(cudaStreamDestroy(program), cudaSuccess);
}

TEST(CudaDevice, MemsetAndCopiesRoundTrip) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  constexpr std::size_t n = 100003;
  DeviceBuffer buffer = device->allocate(n, MemoryCategory::buffers);
  std::vector<unsigned char> host(n, 0);
  device->memset_async(buffer.data(), 0xab, n, *stream);
  device->copy_async(host.data(), buffer.data(), n, *stream);
  stream->synchronize();
  EXPECT_EQ(host, std::vector<unsigned char>(n, 0xab));
  std::vector<unsigned char> pattern(n);
  for (std::size_t i = 0; i < n; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 3);
  device->copy_async(buffer.data(), pattern.data(), n, *stream);
  device->memset_async(buffer.as<unsigned char>() + 10, 0, 5, *stream);
  device->copy_async(host.data(), buffer.data(), n, *stream);
  device->copy_async(host.data(), buffer.data(), 0, *stream);  // nothing to do is fine
  stream->synchronize();
  for (std::size_t i = 10; i < 15; ++i) pattern[i] = 0;
  EXPECT_EQ(host, pattern);
}

// A copy on one stream, delayed by a host task, and a copy on another stream that waits on an
// event after it: the second copy sees the first's data only if the wait really orders them.
TEST(CudaDevice, EventsOrderWorkAcrossStreams) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto producer = device->create_stream();
  auto consumer = device->create_stream();
  auto done = device->create_event();
  EXPECT_TRUE(done->ready());  // never recorded
  EXPECT_NO_THROW(done->synchronize());

  constexpr std::size_t n = 1 << 20;
  HostBuffer source = device->allocate_pinned(n * sizeof(float));
  HostBuffer result = device->allocate_pinned(n * sizeof(float));
  for (std::size_t i = 0; i < n; ++i) source.as<float>()[i] = static_cast<float>(i) + 0.5f;
  std::memset(result.data(), 0, n * sizeof(float));
  DeviceBuffer buffer = device->allocate(n * sizeof(float), MemoryCategory::buffers);
  device->memset_async(buffer.data(), 0, n * sizeof(float), *producer);
  producer->synchronize();

  std::atomic<bool> release{false};
  producer->host_task([&release] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  device->copy_async(buffer.data(), source.data(), n * sizeof(float), *producer);
  producer->record(*done);
  consumer->wait(*done);
  device->copy_async(result.data(), buffer.data(), n * sizeof(float), *consumer);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(done->ready()) << "the event completed while the producer was still held";
  release = true;
  consumer->synchronize();
  EXPECT_TRUE(done->ready());
  EXPECT_EQ(std::memcmp(result.data(), source.data(), n * sizeof(float)), 0);
}

TEST(CudaDevice, HostTaskErrorsReachTheHost) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  auto after_failure = device->create_event();
  std::vector<int> ran;
  stream->host_task([&ran] { ran.push_back(1); });
  stream->host_task([] { throw IoError("reading the shard", "/nvme/shard", 4096, 512, 5); });
  stream->host_task([&ran] { ran.push_back(3); });  // skipped: it would use what failed
  stream->record(*after_failure);
  try {
    stream->synchronize();
    FAIL() << "no IoError";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), "/nvme/shard");
    EXPECT_EQ(error.offset(), 4096u);
  }
  EXPECT_EQ(ran, std::vector<int>{1});
  // Reported once; the stream then runs new work normally.
  EXPECT_NO_THROW(stream->synchronize());
  stream->host_task([&ran] { ran.push_back(4); });
  EXPECT_NO_THROW(stream->synchronize());
  EXPECT_EQ(ran, (std::vector<int>{1, 4}));
  // The mark recorded after the failure still carries it; a mark recorded now does not.
  EXPECT_THROW(after_failure->synchronize(), IoError);
  auto later = device->create_event();
  stream->record(*later);
  EXPECT_NO_THROW(later->synchronize());
}

TEST(CudaDevice, DeviceSynchronizeReportsAnyStreamsError) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto quiet = device->create_stream();
  auto failing = device->create_stream();
  quiet->host_task([] {});
  failing->host_task([] { throw std::runtime_error("host task failed on purpose"); });
  try {
    device->synchronize();
    FAIL() << "no error";
  } catch (const std::runtime_error& error) {
    EXPECT_STREQ(error.what(), "host task failed on purpose");
  }
  EXPECT_NO_THROW(failing->synchronize());
  EXPECT_NO_THROW(device->synchronize());
}

TEST(CudaDevice, EventsAndStreamsOfOtherBackendsAreRejected) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto cpu = make_cpu_device(kMiB);
  auto cpu_stream = cpu->create_stream();
  auto cpu_event = cpu->create_event();
  auto stream = device->create_stream();
  DeviceBuffer buffer = device->allocate(64, MemoryCategory::buffers);
  EXPECT_THROW(device->memset_async(buffer.data(), 0, 64, *cpu_stream), SystemError);
  EXPECT_THROW(stream->record(*cpu_event), SystemError);
  EXPECT_THROW(stream->wait(*cpu_event), SystemError);
  EXPECT_NE(cuda_stream_handle(*stream), nullptr);
}

TEST(CudaDevice, PinnedMemoryIsLockedCountedAndCopiable) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  {
    HostBuffer pinned = device->allocate_pinned(10000);
    EXPECT_TRUE(pinned.locked());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pinned.data()) % 4096, 0u);
    const HostMemoryStats stats = device->pinned_stats();
    EXPECT_EQ(stats.current, 10000u);
    EXPECT_EQ(stats.locked, 10000u);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, pinned.data()), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
    EXPECT_EQ(device->memory_stats().current_total, 0u) << "pinned memory is not device memory";
  }
  EXPECT_EQ(device->pinned_stats().current, 0u);
  EXPECT_EQ(device->pinned_stats().peak, 10000u);
}

// --- the cast kernel, bit for bit against runtime/host/half.hpp

template <class T>
std::vector<T> run_cast(Device& device, Stream& stream, const void* host_src, DType src_type,
                        DType dst_type, std::size_t count) {
  DeviceBuffer src = device.allocate(count * dtype_size(src_type), MemoryCategory::buffers);
  DeviceBuffer dst = device.allocate(count * dtype_size(dst_type), MemoryCategory::buffers);
  device.copy_async(src.data(), host_src, count * dtype_size(src_type), stream);
  kernels::cast_async(src.data(), src_type, dst.data(), dst_type, count, cuda_stream_handle(stream));
  std::vector<T> out(count);
  device.copy_async(out.data(), dst.data(), count * sizeof(T), stream);
  stream.synchronize();
  return out;
}

std::vector<std::uint16_t> every_16_bit_pattern() {
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  return all;
}

TEST(CastKernel, WideningEveryPatternMatchesTheHost) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  const auto all = every_16_bit_pattern();
  const auto from_bf16 = run_cast<float>(*device, *stream, all.data(), DType::bf16, DType::f32, all.size());
  const auto from_fp16 = run_cast<float>(*device, *stream, all.data(), DType::f16, DType::f32, all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(float_bits(from_bf16[i]), float_bits(bf16_to_float(all[i]))) << "bf16 0x" << std::hex << i;
    ASSERT_EQ(float_bits(from_fp16[i]), float_bits(fp16_to_float(all[i]))) << "fp16 0x" << std::hex << i;
  }
}

TEST(CastKernel, BetweenHalfFormatsEveryPatternMatchesTheHost) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  const auto all = every_16_bit_pattern();
  const auto to_fp16 = run_cast<std::uint16_t>(*device, *stream, all.data(), DType::bf16, DType::f16, all.size());
  const auto to_bf16 = run_cast<std::uint16_t>(*device, *stream, all.data(), DType::f16, DType::bf16, all.size());
  const auto same = run_cast<std::uint16_t>(*device, *stream, all.data(), DType::bf16, DType::bf16, all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(to_fp16[i], float_to_fp16(bf16_to_float(all[i]))) << "bf16 0x" << std::hex << i;
    ASSERT_EQ(to_bf16[i], float_to_bf16(fp16_to_float(all[i]))) << "fp16 0x" << std::hex << i;
  }
  EXPECT_EQ(same, all);
}

// Random bit patterns (every exponent, NaNs, Infs, subnormals), the rounding edges, and a count
// beyond one launch's grid so the grid-stride loop and 64-bit indexing carry on past it.
TEST(CastKernel, NarrowingFloatsMatchesTheHost) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  constexpr std::size_t n = (std::size_t{3} << 20) + 7;
  std::vector<float> floats(n);
  std::mt19937 rng(5);
  for (std::size_t i = 0; i < n; ++i) {
    floats[i] = i % 2 == 0 ? bits_float(static_cast<std::uint32_t>(rng()))
                           : std::normal_distribution<float>(0.0f, 100.0f)(rng);
  }
  const std::uint32_t edges[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                 0x7f800001u, 0x3f808000u, 0x3f818000u, 0x477ff000u, 0x477fefffu,
                                 0x33000000u, 0x33000001u, 0x38800000u, 0x387fe000u, 0x7f7fffffu};
  for (std::size_t i = 0; i < std::size(edges); ++i) floats[i * 3] = bits_float(edges[i]);
  const auto to_bf16 = run_cast<std::uint16_t>(*device, *stream, floats.data(), DType::f32, DType::bf16, n);
  const auto to_fp16 = run_cast<std::uint16_t>(*device, *stream, floats.data(), DType::f32, DType::f16, n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(to_bf16[i], float_to_bf16(floats[i])) << "float bits 0x" << std::hex << float_bits(floats[i]);
    ASSERT_EQ(to_fp16[i], float_to_fp16(floats[i])) << "float bits 0x" << std::hex << float_bits(floats[i]);
  }
}

TEST(CastKernel, OddOffsetsAndEmptyCounts) {
  SKIP_WITHOUT_GPU();
  auto device = make_cuda_device(0, 0);
  auto stream = device->create_stream();
  constexpr std::size_t n = 1001;
  std::vector<float> floats(n + 1);
  for (std::size_t i = 0; i < floats.size(); ++i) floats[i] = static_cast<float>(i) * 0.37f - 100.0f;
  DeviceBuffer src = device->allocate(floats.size() * sizeof(float), MemoryCategory::buffers);
  DeviceBuffer dst = device->allocate((n + 1) * sizeof(std::uint16_t), MemoryCategory::buffers);
  device->copy_async(src.data(), floats.data(), floats.size() * sizeof(float), *stream);
  device->memset_async(dst.data(), 0xff, (n + 1) * sizeof(std::uint16_t), *stream);
  // Start one element in: neither pointer is 8- or 16-byte aligned.
  kernels::cast_async(src.as<float>() + 1, DType::f32, dst.as<std::uint16_t>() + 1, DType::f16, n - 1,
                      cuda_stream_handle(*stream));
  kernels::cast_async(src.data(), DType::f32, dst.data(), DType::f16, 0, cuda_stream_handle(*stream));
  std::vector<std::uint16_t> out(n + 1);
  device->copy_async(out.data(), dst.data(), out.size() * sizeof(std::uint16_t), *stream);
  stream->synchronize();
  EXPECT_EQ(out[0], 0xffffu) << "the empty cast wrote";
  for (std::size_t i = 1; i < n; ++i) ASSERT_EQ(out[i], float_to_fp16(floats[i])) << i;
  EXPECT_EQ(out[n], 0xffffu) << "the cast wrote past its count";
}

}  // namespace
}  // namespace zest
