// The cuda backend of zest::Device: cached cudaMalloc, cudaHostAlloc, non-blocking CUDA streams,
// timing-free events, host tasks as host callbacks. Plain C++ against cudart.
//
// Every call that depends on the current device sets it first: allocation, streams and events may
// be created and used from any host thread (offload workers, the trainer's thread), and a thread's
// current device is per thread. It is not restored afterwards: a rank drives one GPU, and leaving
// the thread on it makes the caller's own launches land there too.
#include "runtime/device/cuda_device.hpp"

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <source_location>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/device/block_cache.hpp"
#include "runtime/device/cuda_check.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

void set_device(int ordinal) { ZEST_CUDA_CHECK(cudaSetDevice(ordinal)); }

// For destructors and noexcept release paths: nothing sensible can be done with a failure there,
// and the next checked call reports a sticky error anyway.
void set_device_quietly(int ordinal) noexcept { static_cast<void>(cudaSetDevice(ordinal)); }

// After an out-of-memory return the runtime still holds the error as "last error"; clear it so a
// later cudaGetLastError() after a kernel launch does not blame that launch.
void clear_last_error() noexcept { static_cast<void>(cudaGetLastError()); }

std::string device_label(int ordinal) { return fmt::format("cuda:{}", ordinal); }

// The errors of one stream's host tasks, shared by the stream, its pending callbacks (which may
// run after the Stream object is gone), the events recorded on it and its device.
//
// Semantics follow the cpu backend where CUDA allows: the first exception fails the stream, and
// later host tasks are skipped (they would consume what the failed task did not produce) until the
// error reaches the host through Stream::synchronize() or Device::synchronize(); an event whose
// mark came after the failed task rethrows it from Event::synchronize(), even once reported.
// Unlike the cpu backend, copies and kernels cannot be skipped, and a failure does not travel
// through Stream::wait() to the waiting stream.
class StreamErrors {
 public:
  // Host tasks are numbered from 1 in submission order (by the one submitting thread).
  std::uint64_t next_sequence() noexcept { return submitted_.fetch_add(1) + 1; }
  std::uint64_t submitted() const noexcept { return submitted_.load(); }

  // Called on CUDA's callback thread.
  bool failed() const noexcept {
    std::lock_guard lock(mutex_);
    return unreported_;
  }
  void record(std::exception_ptr error, std::uint64_t sequence) noexcept {
    std::lock_guard lock(mutex_);
    if (unreported_) return;
    try {
      history_.emplace_back(sequence, std::move(error));
      unreported_ = true;
    } catch (...) {
      // No memory to keep it: the error is lost, but the callback thread must not see a throw.
    }
  }

  // The error not yet reported to the host, now reported (null when none).
  std::exception_ptr take_unreported() noexcept {
    std::lock_guard lock(mutex_);
    if (!unreported_) return nullptr;
    unreported_ = false;
    floor_ = history_.back().first;
    return history_.back().second;
  }

  // Errors of tasks numbered at or below the floor have been reported; a mark recorded now must
  // not carry them.
  std::uint64_t floor() const noexcept {
    std::lock_guard lock(mutex_);
    return floor_;
  }

  // The error of a task numbered in (floor, mark], or null.
  std::exception_ptr error_between(std::uint64_t floor, std::uint64_t mark) const noexcept {
    std::lock_guard lock(mutex_);
    for (const auto& [sequence, error] : history_) {
      if (sequence > floor && sequence <= mark) return error;
    }
    return nullptr;
  }

 private:
  std::atomic<std::uint64_t> submitted_{0};
  mutable std::mutex mutex_;
  // One entry per failure (later tasks are skipped until it is reported), so it stays tiny.
  std::vector<std::pair<std::uint64_t, std::exception_ptr>> history_;
  bool unreported_ = false;
  std::uint64_t floor_ = 0;
};

// What a host callback owns. A lockstep task runs after a failure too (Stream::lockstep_task).
struct HostTask {
  std::function<void(bool stream_failed)> task;
  bool lockstep = false;
  std::shared_ptr<StreamErrors> errors;
  std::uint64_t sequence = 0;
};

void CUDART_CB run_host_task(void* data) {
  const std::unique_ptr<HostTask> host_task(static_cast<HostTask*>(data));
  const bool failed = host_task->errors->failed();
  if (failed && !host_task->lockstep) return;
  try {
    host_task->task(failed);
  } catch (...) {
    // An exception must not cross into the CUDA runtime's callback thread.
    host_task->errors->record(std::current_exception(), host_task->sequence);
  }
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) : ordinal_(ordinal) {
    set_device(ordinal_);
    ZEST_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    set_device_quietly(ordinal_);
    static_cast<void>(cudaEventDestroy(event_));
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void synchronize() override {
    ZEST_CUDA_CHECK(cudaEventSynchronize(event_));
    if (!errors_) return;
    if (std::exception_ptr error = errors_->error_between(floor_, mark_)) {
      std::rethrow_exception(error);
    }
  }

  bool ready() const override {
    const cudaError_t code = cudaEventQuery(event_);
    if (code == cudaErrorNotReady) return false;
    ZEST_CUDA_CHECK(code);
    return true;
  }

  cudaEvent_t handle() const { return event_; }
  int ordinal() const { return ordinal_; }

  // Called by CudaStream::record after cudaEventRecord succeeded.
  void marked(std::shared_ptr<StreamErrors> errors) {
    floor_ = errors->floor();
    mark_ = errors->submitted();
    errors_ = std::move(errors);
  }

 private:
  int ordinal_;
  cudaEvent_t event_ = nullptr;
  std::shared_ptr<StreamErrors> errors_;  // of the stream that last recorded this event
  std::uint64_t floor_ = 0;               // its host tasks whose errors were reported before
  std::uint64_t mark_ = 0;                // its host tasks submitted before the mark
};

// Event or const Event in, CudaEvent or const CudaEvent out.
template <class AnyEvent>
auto& as_cuda_event(AnyEvent& event, const char* operation) {
  using Target = std::conditional_t<std::is_const_v<AnyEvent>, const CudaEvent, CudaEvent>;
  auto* cuda_event = dynamic_cast<Target*>(&event);
  if (cuda_event == nullptr) {
    throw SystemError(std::string(operation)
                          .append(": the event was not made by a cuda Device; create events with "
                                  "the same Device as the stream"));
  }
  return *cuda_event;
}

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int ordinal) : ordinal_(ordinal) {
    set_device(ordinal_);
    // Non-blocking: zest's streams must not serialize with the legacy default stream the trainer
    // (or a library it uses) may be launching on.
    ZEST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  // The program's stream (Device::borrow_stream): used, never destroyed.
  CudaStream(int ordinal, cudaStream_t borrowed) : ordinal_(ordinal), stream_(borrowed), borrowed_(true) {}
  // Waits for the submitted work first, as the cpu backend's worker is joined: host tasks may
  // refer to objects their submitter destroys right after the stream. A borrowed stream is the
  // program's: zest queued no host task there, and its other work is the program's to wait for.
  ~CudaStream() override {
    if (borrowed_) return;
    set_device_quietly(ordinal_);
    static_cast<void>(cudaStreamSynchronize(stream_));
    static_cast<void>(cudaStreamDestroy(stream_));
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  void record(Event& event) override {
    CudaEvent& cuda_event = as_cuda_event(event, "Stream::record");
    ZEST_CUDA_CHECK(cudaEventRecord(cuda_event.handle(), stream_));
    cuda_event.marked(errors_);
  }

  void wait(const Event& event) override {
    const CudaEvent& cuda_event = as_cuda_event(event, "Stream::wait");
    ZEST_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event.handle(), 0));
  }

  void host_task(std::function<void()> task) override {
    launch_host_task([task = std::move(task)](bool) { task(); }, false);
  }

  void lockstep_task(std::function<void(bool stream_failed)> task) override { launch_host_task(std::move(task), true); }

  void synchronize() override {
    ZEST_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (std::exception_ptr error = errors_->take_unreported()) std::rethrow_exception(error);
  }

  cudaStream_t handle() const { return stream_; }

  int ordinal() const { return ordinal_; }
  const std::shared_ptr<StreamErrors>& errors() const { return errors_; }

 private:
  void launch_host_task(std::function<void(bool)> task, bool lockstep) {
    auto payload = std::make_unique<HostTask>(HostTask{std::move(task), lockstep, errors_, errors_->submitted() + 1});
    ZEST_CUDA_CHECK(cudaLaunchHostFunc(stream_, run_host_task, payload.get()));
    payload.release();  // the callback owns it now
    errors_->next_sequence();
  }

  int ordinal_;
  cudaStream_t stream_ = nullptr;
  bool borrowed_ = false;
  std::shared_ptr<StreamErrors> errors_ = std::make_shared<StreamErrors>();
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::size_t budget, std::string gpu_name, std::vector<int> host_cpus,
             std::shared_ptr<DeviceMemorySource> memory)
      : Device(budget, std::move(host_cpus)),
        ordinal_(ordinal),
        name_(device_label(ordinal)),
        memory_(std::move(memory)) {
    name_ += fmt::format(" ({})", gpu_name);
  }

  // Every DeviceBuffer has been returned by now (they must not outlive their Device); what is
  // left in the cache goes back to the driver.
  ~CudaDevice() override {
    std::lock_guard lock(cache_mutex_);
    release_cached_blocks();
  }

  DeviceType type() const override { return DeviceType::cuda; }
  std::string name() const override { return name_; }
  bool host_accessible() const override { return false; }
  int ordinal() const { return ordinal_; }

  std::unique_ptr<Stream> create_stream() override {
    auto stream = std::make_unique<CudaStream>(ordinal_);
    std::lock_guard lock(streams_mutex_);
    std::erase_if(stream_errors_, [](const auto& errors) { return errors.expired(); });
    stream_errors_.push_back(stream->errors());
    return stream;
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(ordinal_); }

  std::unique_ptr<Stream> borrow_stream(void* native_stream) override {
    // cudaStreamLegacy and cudaStreamPerThread are handles too, but not null: a null handle is
    // the legacy default stream only by accident of the caller, so it is refused.
    if (native_stream == nullptr)
      throw Error("Device::borrow_stream on " + name_ +
                  ": the stream handle is null; pass the cudaStream_t the program computes on");
    return std::make_unique<CudaStream>(ordinal_, static_cast<cudaStream_t>(native_stream));
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    const cudaStream_t handle = own_stream(stream, "copy_async");
    if (bytes == 0) return;
    set_device(ordinal_);
    // cudaMemcpyDefault: unified addressing tells device from (pinned or pageable) host memory.
    ZEST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, handle));
  }

  void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    const cudaStream_t handle = own_stream(stream, "memset_async");
    if (bytes == 0) return;
    set_device(ordinal_);
    ZEST_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, handle));
  }

  // As the cpu backend's: waits for everything, then reports the first host-task error of any
  // live stream (and marks every stream's error reported, as each stream's synchronize would).
  void synchronize() override {
    set_device(ordinal_);
    ZEST_CUDA_CHECK(cudaDeviceSynchronize());
    std::exception_ptr first;
    {
      std::lock_guard lock(streams_mutex_);
      for (const auto& weak : stream_errors_) {
        if (const auto errors = weak.lock()) {
          std::exception_ptr error = errors->take_unreported();
          if (!first) first = std::move(error);
        }
      }
    }
    if (first) std::rethrow_exception(first);
  }

 protected:
  void* allocate_bytes(std::size_t bytes) override {
    if (memory_) {
      set_device(ordinal_);
      return memory_->allocate(bytes);
    }
    const std::size_t rounded = BlockCache::rounded_size(bytes);
    std::lock_guard lock(cache_mutex_);
    if (void* block = cache_.take(rounded)) return block;
    set_device(ordinal_);
    void* block = nullptr;
    cudaError_t code = cudaMalloc(&block, rounded);
    if (code == cudaErrorMemoryAllocation) {
      // The cache may hold what this request needs, in blocks of other sizes.
      clear_last_error();
      release_cached_blocks();
      code = cudaMalloc(&block, rounded);
      if (code == cudaErrorMemoryAllocation) {
        clear_last_error();
        return nullptr;  // the base class throws OutOfDeviceMemory with the budget and categories
      }
    }
    if (code != cudaSuccess) {
      const std::string call = fmt::format("cudaMalloc({} bytes)", rounded);
      detail::throw_cuda_error(call.c_str(), code, std::source_location::current());
    }
    return block;
  }

  void free_bytes(void* data, std::size_t bytes) noexcept override {
    if (memory_) {
      set_device_quietly(ordinal_);
      memory_->free(data, bytes);
      return;
    }
    const std::size_t rounded = BlockCache::rounded_size(bytes);
    std::lock_guard lock(cache_mutex_);
    try {
      cache_.put(data, rounded);
    } catch (...) {
      // No memory for the cache's bookkeeping: give the block back to the driver instead.
      set_device_quietly(ordinal_);
      static_cast<void>(cudaFree(data));
    }
  }

  void* allocate_pinned_bytes(std::size_t bytes, bool& locked) override {
    set_device(ordinal_);
    void* data = nullptr;
    // Portable: offload threads copy through it with whatever device their thread has current.
    const cudaError_t code = cudaHostAlloc(&data, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
    if (code == cudaErrorMemoryAllocation) {
      clear_last_error();
      return nullptr;
    }
    if (code != cudaSuccess) {
      const std::string call = fmt::format("cudaHostAlloc({} bytes)", bytes);
      detail::throw_cuda_error(call.c_str(), code, std::source_location::current());
    }
    locked = true;
    return data;
  }

  void free_pinned_bytes(void* data, std::size_t /*bytes*/) noexcept override {
    set_device_quietly(ordinal_);
    static_cast<void>(cudaFreeHost(data));
  }

  void add_backend_stats(MemoryStats& stats) const override {
    set_device(ordinal_);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    ZEST_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    stats.driver_free = free_bytes;
    stats.driver_total = total_bytes;
  }

 private:
  // Caller holds cache_mutex_. cudaFree synchronizes the GPU, which is why this happens only when
  // memory runs out or the device goes away.
  void release_cached_blocks() noexcept {
    set_device_quietly(ordinal_);
    cache_.drain([](void* block, std::size_t) { static_cast<void>(cudaFree(block)); });
  }

  cudaStream_t own_stream(Stream& stream, const char* operation) const {
    auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
    if (cuda_stream == nullptr) {
      throw SystemError(fmt::format(
          "{} on {}: the stream was not made by a cuda Device; create it with this Device's create_stream()", operation,
          name_));
    }
    if (cuda_stream->ordinal() != ordinal_) {
      throw SystemError(fmt::format("{} on {}: the stream belongs to {}; create it with this Device's create_stream()",
                                    operation, name_, device_label(cuda_stream->ordinal())));
    }
    return cuda_stream->handle();
  }

  int ordinal_;
  std::string name_;
  std::shared_ptr<DeviceMemorySource> memory_;  // the program's allocator, or null: cache_ over cudaMalloc
  std::mutex cache_mutex_;
  BlockCache cache_;
  // The streams this device made, held weakly: a destroyed stream has drained already.
  std::mutex streams_mutex_;
  std::vector<std::weak_ptr<StreamErrors>> stream_errors_;
};

}  // namespace

cudaStream_t cuda_stream_handle(Stream& stream) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  if (cuda_stream == nullptr) {
    throw CommError(
        "the stream is not a CUDA stream: NCCL collectives and CUDA kernels run on streams made by "
        "a cuda Device; create the stream with the communicator's device (device.type: cuda), or "
        "use comm.backend: mpi with a cpu device");
  }
  return cuda_stream->handle();
}

int cuda_device_ordinal(const Device& device) noexcept {
  const auto* cuda_device = dynamic_cast<const CudaDevice*>(&device);
  return cuda_device == nullptr ? -1 : cuda_device->ordinal();
}

bool cuda_device_available() {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    clear_last_error();
    return false;
  }
  return count > 0;
}

std::unique_ptr<Device> make_cuda_device(int ordinal, std::size_t budget, std::vector<int> host_cpus,
                                         std::shared_ptr<DeviceMemorySource> memory) {
  if (ordinal < 0) {
    throw SystemError(
        fmt::format("cuda device ordinal {} is negative; pass the local rank or a GPU index >= 0", ordinal));
  }
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess || count == 0) {
    clear_last_error();
    std::string reason = code != cudaSuccess ? fmt::format("{} ({})", cudaGetErrorName(code), cudaGetErrorString(code))
                                             : std::string("it reports 0 devices");
    throw SystemError(std::string("no CUDA GPU is visible: cudaGetDeviceCount: ")
                          .append(reason)
                          .append("; check the NVIDIA driver and CUDA_VISIBLE_DEVICES, or set "
                                  "device.type: cpu"));
  }
  const int chosen = ordinal % count;
  set_device(chosen);
  cudaDeviceProp properties{};
  ZEST_CUDA_CHECK(cudaGetDeviceProperties(&properties, chosen));
  const std::size_t resolved_budget = budget == 0 ? properties.totalGlobalMem : budget;
  return std::make_unique<CudaDevice>(chosen, resolved_budget, properties.name, std::move(host_cpus),
                                      std::move(memory));
}

}  // namespace zest
