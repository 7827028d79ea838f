#include "runtime/device/cpu_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "runtime/host/sys_check.hpp"
#include "zest/error.hpp"

// Linux 5.14 added MADV_POPULATE_WRITE; older headers lack the name, older kernels return EINVAL.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace zest {
namespace {

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t round_up(std::size_t bytes, std::size_t multiple) {
  return (bytes + multiple - 1) / multiple * multiple;
}

// Faults every page in now, so the first touch inside a step costs nothing.
void prefault(void* data, std::size_t length) {
  if (::madvise(data, length, MADV_POPULATE_WRITE) == 0) return;
  // Older kernel (EINVAL): touch each page. A write, so the page is private and backed.
  auto* bytes = static_cast<volatile unsigned char*>(data);
  for (std::size_t offset = 0; offset < length; offset += page_size()) bytes[offset] = 0;
}

}  // namespace

CpuDevice::CpuDevice(std::size_t budget, std::vector<int> host_cpus)
    : Device(budget, std::move(host_cpus)), streams_(std::make_shared<detail::CpuStreamRegistry>()) {
  if (budget == 0) {
    throw Error(
        "cpu device: the memory budget is 0 bytes; set device.memory to the bytes zest may use "
        "(e.g. 2GiB)");
  }
}

// Streams, buffers and events must go before their device (the Device contract); nothing to drain.
CpuDevice::~CpuDevice() = default;

std::unique_ptr<Stream> CpuDevice::create_stream() { return std::make_unique<CpuStream>(streams_, host_cpus()); }

std::unique_ptr<Event> CpuDevice::create_event() { return std::make_unique<CpuEvent>(); }

CpuStream& CpuDevice::own_stream(Stream& stream, const char* operation) const {
  CpuStream* cpu = as_cpu_stream(stream);
  if (cpu == nullptr || cpu->registry() != streams_.get()) {
    throw Error(std::string("cpu device: ").append(operation).append(
        ": the stream was not created by this device; use a stream from this device's "
        "create_stream()"));
  }
  return *cpu;
}

void CpuDevice::copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) {
  CpuStream& cpu = own_stream(stream, "copy_async");
  if (bytes == 0) return;
  cpu.host_task([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

void CpuDevice::memset_async(void* dst, int value, std::size_t bytes, Stream& stream) {
  CpuStream& cpu = own_stream(stream, "memset_async");
  if (bytes == 0) return;
  cpu.host_task([dst, value, bytes] { std::memset(dst, value, bytes); });
}

void CpuDevice::synchronize() { streams_->synchronize_all(); }

void* CpuDevice::allocate_bytes(std::size_t bytes) {
  return ::operator new(bytes, std::align_val_t{kAlignment}, std::nothrow);
}

void CpuDevice::free_bytes(void* data, std::size_t /*bytes*/) noexcept {
  ::operator delete(data, std::align_val_t{kAlignment});
}

void* CpuDevice::allocate_pinned_bytes(std::size_t bytes, bool& locked) {
  const std::size_t length = round_up(bytes, page_size());
  void* data = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    if (errno == ENOMEM) return nullptr;
    detail::throw_sys_error("mmap (pinned host memory)", errno, std::source_location::current());
  }
  // Fewer TLB misses on big staging buffers; only a hint, so its failure does not matter.
  if (length >= kHugePageThreshold) (void)::madvise(data, length, MADV_HUGEPAGE);
  prefault(data, length);
  // Best effort: RLIMIT_MEMLOCK is often small in containers, and unlocked memory still works.
  locked = ::mlock(data, length) == 0;
  return data;
}

void CpuDevice::free_pinned_bytes(void* data, std::size_t bytes) noexcept {
  // munmap also drops the lock.
  (void)::munmap(data, round_up(bytes, page_size()));
}

std::unique_ptr<Device> make_cpu_device(std::size_t budget, std::vector<int> host_cpus) {
  return std::make_unique<CpuDevice>(budget, std::move(host_cpus));
}

}  // namespace zest
