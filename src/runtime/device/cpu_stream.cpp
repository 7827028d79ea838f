#include "runtime/device/cpu_stream.hpp"

#include <utility>

#include "runtime/host/thread_binding.hpp"
#include "zest/error.hpp"

namespace zest {
namespace detail {

void CpuMark::complete(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

std::exception_ptr CpuMark::wait() const {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] { return done_; });
  return error_;
}

bool CpuMark::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

// The queue and the thread behind a CpuStream. Shared with the device's registry so that
// Device::synchronize() never touches a stream that is being destroyed.
class CpuStreamWorker {
 public:
  enum class Kind { work, lockstep, mark, wait };
  struct Task {
    Kind kind = Kind::work;
    std::function<void()> work;
    std::shared_ptr<CpuMark> mark;
    std::function<void(bool)> lockstep;
  };

  explicit CpuStreamWorker(std::vector<int> cpus) : cpus_(std::move(cpus)), thread_([this] { run(); }) {}

  ~CpuStreamWorker() { stop(); }

  void submit(Task task) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
      ++submitted_;
    }
    work_cv_.notify_one();
  }

  // Waits for the work submitted so far and takes the stream's error (leaving it healthy).
  std::exception_ptr drain() {
    if (std::this_thread::get_id() == thread_.get_id()) {
      throw Error(
          "synchronize() was called from a task running on the stream it waits for, which would "
          "wait forever; synchronize from the host thread, or order the work with events");
    }
    std::unique_lock lock(mutex_);
    const std::uint64_t target = submitted_;
    idle_cv_.wait(lock, [&] { return completed_ >= target; });
    return std::exchange(error_, nullptr);
  }

  // Runs what is queued, then ends the thread. Idempotent.
  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
  }

 private:
  void run() {
    // A stream's work (copies to and from the host, the MPI collectives) is this rank's host work:
    // it keeps to the rank's cores. A refused binding only costs speed.
    if (!cpus_.empty()) static_cast<void>(try_bind_current_thread(cpus_));
    std::unique_lock lock(mutex_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      Task task = std::move(queue_.front());
      queue_.pop_front();
      const std::exception_ptr failed = error_;
      lock.unlock();

      std::exception_ptr raised;
      switch (task.kind) {
        case Kind::work:
          if (!failed) {
            try {
              task.work();
            } catch (...) {
              raised = std::current_exception();
            }
          }
          break;
        case Kind::lockstep:
          try {
            task.lockstep(failed != nullptr);
          } catch (...) {
            raised = std::current_exception();
          }
          break;
        case Kind::mark:
          task.mark->complete(failed);
          break;
        case Kind::wait:
          if (!failed) raised = task.mark->wait();
          break;
      }
      // Whatever the task captured is released here, not under the lock.
      task = Task{};

      lock.lock();
      if (raised && !error_) error_ = std::move(raised);
      ++completed_;
      idle_cv_.notify_all();
    }
  }

  const std::vector<int> cpus_;  // where the worker runs; empty: where it was started
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<Task> queue_;
  std::uint64_t submitted_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once everything above is initialized
};

void CpuStreamRegistry::add(const std::shared_ptr<CpuStreamWorker>& worker) {
  std::lock_guard lock(mutex_);
  std::erase_if(workers_, [](const std::weak_ptr<CpuStreamWorker>& w) { return w.expired(); });
  workers_.push_back(worker);
}

void CpuStreamRegistry::synchronize_all() {
  std::vector<std::shared_ptr<CpuStreamWorker>> live;
  {
    std::lock_guard lock(mutex_);
    for (const auto& weak : workers_)
      if (auto worker = weak.lock()) live.push_back(std::move(worker));
  }
  // Drain outside the lock: a task may create or destroy streams of this device meanwhile.
  std::exception_ptr first;
  for (const auto& worker : live) {
    std::exception_ptr error = worker->drain();
    if (error && !first) first = std::move(error);
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace detail

namespace {

const CpuEvent& cpu_event(const Event& event, const char* operation) {
  const auto* cpu = dynamic_cast<const CpuEvent*>(&event);
  if (cpu == nullptr) {
    throw Error(std::string(operation).append(
        ": the event was not created by a cpu device; create events with the device that "
        "created the stream"));
  }
  return *cpu;
}

}  // namespace

void CpuEvent::synchronize() {
  const std::shared_ptr<detail::CpuMark> current = mark();
  if (!current) return;
  if (std::exception_ptr error = current->wait()) std::rethrow_exception(error);
}

bool CpuEvent::ready() const {
  const std::shared_ptr<detail::CpuMark> current = mark();
  return !current || current->done();
}

std::shared_ptr<detail::CpuMark> CpuEvent::mark() const {
  std::lock_guard lock(mutex_);
  return mark_;
}

void CpuEvent::set_mark(std::shared_ptr<detail::CpuMark> mark) {
  std::lock_guard lock(mutex_);
  mark_ = std::move(mark);
}

CpuStream::CpuStream(std::shared_ptr<detail::CpuStreamRegistry> registry, std::vector<int> cpus)
    : registry_(std::move(registry)), worker_(std::make_shared<detail::CpuStreamWorker>(std::move(cpus))) {
  if (registry_) registry_->add(worker_);
}

// Drains and joins here, so the device's registry only ever sees streams that are finished or
// alive. An error nobody synchronized for is dropped: a destructor cannot report it.
CpuStream::~CpuStream() { worker_->stop(); }

void CpuStream::record(Event& event) {
  auto& cpu = const_cast<CpuEvent&>(cpu_event(event, "Stream::record"));
  auto mark = std::make_shared<detail::CpuMark>();
  worker_->submit({detail::CpuStreamWorker::Kind::mark, {}, mark, {}});
  cpu.set_mark(std::move(mark));
}

void CpuStream::wait(const Event& event) {
  std::shared_ptr<detail::CpuMark> mark = cpu_event(event, "Stream::wait").mark();
  if (!mark) return;  // never recorded: nothing to wait for (as in CUDA)
  if (mark->done() && mark->wait() == nullptr) return;  // already reached, without error
  worker_->submit({detail::CpuStreamWorker::Kind::wait, {}, std::move(mark), {}});
}

void CpuStream::host_task(std::function<void()> task) {
  if (!task) throw Error("Stream::host_task: the task is empty; pass a callable");
  worker_->submit({detail::CpuStreamWorker::Kind::work, std::move(task), nullptr, {}});
}

void CpuStream::lockstep_task(std::function<void(bool stream_failed)> task) {
  if (!task) throw Error("Stream::lockstep_task: the task is empty; pass a callable");
  worker_->submit({detail::CpuStreamWorker::Kind::lockstep, {}, nullptr, std::move(task)});
}

void CpuStream::synchronize() {
  if (std::exception_ptr error = worker_->drain()) std::rethrow_exception(error);
}

CpuStream* as_cpu_stream(Stream& stream) noexcept { return dynamic_cast<CpuStream*>(&stream); }

}  // namespace zest
