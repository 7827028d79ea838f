// Device: where zest places parameters, gradients, optimizer states and buffers.
//
// Two backends sit behind this interface. cpu: device memory is host memory under a budget, and
// streams are real worker threads, so asynchronous copies and overlap really are asynchronous.
// cuda: cudaMalloc (cached), CUDA streams and events, cudaHostAlloc for pinned memory.
//
// Every byte placed on the device goes through allocate(), which counts it by category (current
// and peak) and throws OutOfDeviceMemory past the budget, the same on both backends.
// Threading: allocate/free and the stats may be called from any thread. A Stream is used by one
// host thread at a time. Buffers, streams and events must not outlive their Device.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "zest/base_types.hpp"

namespace zest {

enum class MemoryCategory : unsigned char { params, grads, optimizer_states, buffers };
inline constexpr std::size_t kMemoryCategoryCount = 4;
std::string_view category_name(MemoryCategory category);

struct MemoryStats {
  std::size_t budget = 0;
  std::array<std::size_t, kMemoryCategoryCount> current{};  // indexed by MemoryCategory
  std::array<std::size_t, kMemoryCategoryCount> peak{};
  std::size_t current_total = 0;
  std::size_t peak_total = 0;     // the peak of the sum, not the sum of the peaks
  std::size_t driver_free = 0;    // cuda: cudaMemGetInfo at the time of the call; cpu: 0
  std::size_t driver_total = 0;

  std::size_t current_of(MemoryCategory c) const { return current[static_cast<std::size_t>(c)]; }
  std::size_t peak_of(MemoryCategory c) const { return peak[static_cast<std::size_t>(c)]; }
};

// What a block of pinned host memory is for, as its caller labels it: the device counts each
// label's bytes apart (HostMemoryStats) and gives labels no meaning. The engine labels its blocks
// by zest::HostPurpose (zest/host_purpose.hpp). A caller's own enumeration labels them once it
// says so (`template <> inline constexpr bool zest::is_host_label<MyLabels> = true;`), so that no
// other enumeration converts by mistake; its values must be below HostLabel::kCount (an Error
// otherwise). Unlabelled blocks count under the last label.
template <class Enum>
inline constexpr bool is_host_label = false;

[[noreturn]] void throw_host_label_out_of_range(std::size_t index);

class HostLabel {
 public:
  static constexpr std::size_t kCount = 8;
  static constexpr HostLabel unlabelled() { return HostLabel(kCount - 1); }
  template <class Enum>
    requires(std::is_enum_v<Enum> && is_host_label<Enum>)
  constexpr HostLabel(Enum value) : HostLabel(static_cast<std::size_t>(value)) {}  // implicit: a label is its value
  constexpr std::size_t index() const { return index_; }

 private:
  explicit constexpr HostLabel(std::size_t index) : index_(index) {
    if (index >= kCount) throw_host_label_out_of_range(index);
  }
  std::size_t index_;
};

// Page-aligned host memory for offload staging, counted apart from device memory.
struct HostMemoryStats {
  std::size_t current = 0;
  std::size_t peak = 0;
  std::size_t locked = 0;  // of `current`, the bytes that are page-locked (pinned)
  std::array<std::size_t, HostLabel::kCount> current_by{};  // indexed by HostLabel::index()
  std::array<std::size_t, HostLabel::kCount> peak_by{};     // each label's own peak

  std::size_t current_of(HostLabel label) const { return current_by[label.index()]; }
  std::size_t peak_of(HostLabel label) const { return peak_by[label.index()]; }
};

class Device;

// Owns one device allocation. Move-only; frees (and uncounts) itself on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  template <class T> T* as() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }
  MemoryCategory category() const { return category_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class Device;
  DeviceBuffer(Device* owner, void* data, std::size_t bytes, MemoryCategory category)
      : owner_(owner), data_(data), bytes_(bytes), category_(category) {}
  void reset() noexcept;

  Device* owner_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::buffers;
};

// Owns one block of page-aligned (and, where the system allows, page-locked) host memory,
// pre-faulted so the first touch inside a step costs nothing. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  void* data() const { return data_; }
  template <class T> T* as() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }
  bool locked() const { return locked_; }
  HostLabel label() const { return label_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class Device;
  HostBuffer(Device* owner, void* data, std::size_t bytes, bool locked, HostLabel label)
      : owner_(owner), data_(data), bytes_(bytes), locked_(locked), label_(label) {}
  void reset() noexcept;

  Device* owner_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool locked_ = false;
  HostLabel label_ = HostLabel::unlabelled();
};

// Marks a point in a stream's work. Recording again moves the mark (CUDA event semantics).
class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the work recorded before the mark has finished; rethrows that work's error.
  virtual void synchronize() = 0;
  // True once the marked work has finished (or when never recorded).
  virtual bool ready() const = 0;
};

// An ordered queue of device work. Work runs asynchronously to the host thread that submits it.
class Stream {
 public:
  virtual ~Stream() = default;
  // Marks the work submitted so far.
  virtual void record(Event& event) = 0;
  // Work submitted after this call starts only once `event`'s marked work has finished.
  virtual void wait(const Event& event) = 0;
  // Runs `task` on a host thread in stream order (cpu: the stream's worker; cuda: a host callback,
  // which must not call CUDA). An exception it throws is rethrown by synchronize().
  virtual void host_task(std::function<void()> task) = 0;
  // After a task fails, the stream skips its later host tasks until synchronize() reports the error.
  // A lockstep task runs all the same, told whether the stream had failed: for work every rank
  // must reach in step (a collective's agreement), so that a rank whose stream failed tells the
  // others instead of leaving them waiting for it. Its own exception is kept if it is the first.
  virtual void lockstep_task(std::function<void(bool stream_failed)> task) = 0;
  // Blocks until all submitted work has finished; rethrows the first error of that work.
  virtual void synchronize() = 0;
};

class MemoryLedger;

// Where a cuda Device's memory comes from: zest's own cache over cudaMalloc by default. A program
// whose framework already manages the GPU's memory gives its allocator instead (zest::torch gives
// torch's CUDA caching allocator), so that one allocator governs the GPU and the framework's
// counters and limits include zest's bytes. The Device still counts every byte by category under
// its budget. allocate returns nullptr when the GPU has no memory left for the request (the Device
// then throws OutOfDeviceMemory); any other failure throws. free gets what allocate gave, after
// zest's streams stopped using it. Both may be called from any thread.
class DeviceMemorySource {
 public:
  virtual ~DeviceMemorySource() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void free(void* data, std::size_t bytes) noexcept = 0;
};

class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceType type() const = 0;
  virtual std::string name() const = 0;
  // True where the host may read and write device memory directly (the cpu backend).
  virtual bool host_accessible() const = 0;

  // Counted against the budget; throws OutOfDeviceMemory naming the budget, the request and the
  // largest categories. Aligned to 256 bytes. Contents are unspecified.
  DeviceBuffer allocate(std::size_t bytes, MemoryCategory category);
  // Pinned host memory for offload, counted separately (pinned_stats), under `label`.
  // Page-aligned, pre-faulted.
  HostBuffer allocate_pinned(std::size_t bytes, HostLabel label = HostLabel::unlabelled());

  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  // A Stream over a stream the program made and keeps (cuda: a cudaStream_t, such as torch's current
  // stream), so that zest can order its work against the program's with events
  // (Engine::set_compute_stream). zest never destroys it, and submits no host task to it. Throws
  // Error on a backend without native streams (cpu) and for a null handle.
  virtual std::unique_ptr<Stream> borrow_stream(void* native_stream);
  // Any direction between device and host memory; both ranges must stay valid until completion.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) = 0;
  virtual void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) = 0;
  // Blocks until all work on all of this device's streams has finished.
  virtual void synchronize() = 0;

  MemoryStats memory_stats() const;
  HostMemoryStats pinned_stats() const;
  // The cpus (OS indices) this rank's host threads run on: the device's stream workers, and the
  // CPU Adam's and offload stores' threads that the engine starts for it (Runtime chooses them,
  // Topology::cpus_for_rank). Empty where none were chosen: threads keep the binding they inherit,
  // and the CPU Adam spreads over every cpu the process may use.
  const std::vector<int>& host_cpus() const { return host_cpus_; }
  // Starts a new peak window (e.g. per step): peaks restart from the current figures.
  void reset_peak();

 protected:
  explicit Device(std::size_t budget, std::vector<int> host_cpus = {});

  // Backend primitives. allocate_bytes returns nullptr when the backend itself is out of memory.
  virtual void* allocate_bytes(std::size_t bytes) = 0;
  virtual void free_bytes(void* data, std::size_t bytes) noexcept = 0;
  // Sets `locked` when the memory is page-locked.
  virtual void* allocate_pinned_bytes(std::size_t bytes, bool& locked) = 0;
  virtual void free_pinned_bytes(void* data, std::size_t bytes) noexcept = 0;
  // Adds what only the backend knows (cudaMemGetInfo) to the ledger's figures.
  virtual void add_backend_stats(MemoryStats& /*stats*/) const {}

 private:
  friend class DeviceBuffer;
  friend class HostBuffer;
  void release(DeviceBuffer& buffer) noexcept;
  void release(HostBuffer& buffer) noexcept;

  std::unique_ptr<MemoryLedger> device_ledger_;
  std::unique_ptr<MemoryLedger> pinned_ledger_;
  std::vector<int> host_cpus_;
};

// The cpu backend: device memory is host memory under `budget` bytes. `host_cpus`: see
// Device::host_cpus (its streams' workers run there).
std::unique_ptr<Device> make_cpu_device(std::size_t budget, std::vector<int> host_cpus = {});
// The cuda backend on GPU `ordinal` modulo the number of visible GPUs (so a rank may pass its local
// rank); `budget` 0 = what the GPU has. `memory`: where its device memory comes from (null: zest's
// cache over cudaMalloc). Throws SystemError when zest was built without CUDA or no GPU is visible.
std::unique_ptr<Device> make_cuda_device(int ordinal, std::size_t budget, std::vector<int> host_cpus = {},
                                         std::shared_ptr<DeviceMemorySource> memory = nullptr);
// True when zest was built with CUDA and at least one GPU is visible.
bool cuda_device_available();

}  // namespace zest
