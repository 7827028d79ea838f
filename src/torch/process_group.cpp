#include "torch/process_group.hpp"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm/collective_call.hpp"
#include "runtime/comm/nccl_communicator.hpp"
#include "zest/error.hpp"

namespace zest::torch::detail {
namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Ranks share a host when they share its hostname and its network namespace: two containers (or
// scripts/sim-hosts.sh's namespaces) on one machine are as far apart as two machines.
std::string host_identity() {
  std::array<char, HOST_NAME_MAX + 1> name{};
  if (gethostname(name.data(), name.size() - 1) != 0) name[0] = '\0';
  std::array<char, 128> net{};
  const ssize_t n = readlink("/proc/self/ns/net", net.data(), net.size() - 1);
  return std::string(name.data()) + "/" + (n > 0 ? std::string(net.data(), static_cast<std::size_t>(n)) : "");
}

std::string group_name(const Group& group) {
  std::string name = group->getGroupName();
  return name.empty() ? std::string("(unnamed)") : name;
}

// A number for each zest world over a group: every rank makes its worlds over a group in the same
// order, so they number them alike, and the keys of two of them never meet in the group's store.
std::uint64_t next_serial(const Group& group) {
  static std::mutex mutex;
  static std::map<std::string, std::uint64_t> serials;
  std::lock_guard lock(mutex);
  return serials[group_name(group)]++;
}

at::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return at::kFloat;
    case DType::f16: return at::kHalf;
    case DType::bf16: return at::kBFloat16;
  }
  throw CommError("torch.distributed communicator: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

c10d::ReduceOp reduce_op(ReduceOp op) { return op == ReduceOp::max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM; }

at::Tensor host_tensor(const void* data, std::size_t count, at::ScalarType type) {
  return at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(count)}, at::TensorOptions().dtype(type));
}

// The maker of groups where the program gives none (C++): splitGroup of the world's group, under
// names its calls make alike on every rank. Options of the base type make gloo start a transport
// device of its own for each split: with the parent's (splitGroup's default), torch 2.11's gloo
// groups split from one parent stop completing collectives after a few are made (two splits and an
// all-reduce, repeated, time out on the third round). gloo's own timeout stays its default;
// comm.timeout bounds zest's waits.
GroupMaker split_groups(const Group& parent) {
  return [parent, made = 0](const std::vector<int>& ranks) mutable -> Group {
    std::string name = group_name(parent) + "/zest" + std::to_string(made++);
    for (const int r : ranks) name.append(":").append(std::to_string(r));
    if (std::find(ranks.begin(), ranks.end(), parent->getRank()) == ranks.end()) return {};
    auto options = c10::make_intrusive<c10d::Backend::Options>(parent->getBackendName());
    return parent->splitGroup(ranks, std::nullopt, options, name, "zest");
  };
}

// zest's collectives on cpu-device buffers over the ranks of a torch.distributed group, on groups
// of zest's own (GroupMaker; they need a cpu backend: gloo), so that zest's traffic never
// interleaves with the program's collectives on the group. Every collective is a lockstep task on the caller's stream:
// the ranks first agree on it (collective_call.hpp; a mismatch raises CommError on every rank and moves nothing), then
// it runs and the stream's worker waits for it. A collective that has not completed after `timeout` raises CommError
// naming it and its number on this rank (gloo cannot tell which peer is behind, as MPI's watchdog does), and the
// communicator is unusable afterwards.
class ProcessGroupCommunicator final : public Communicator {
 public:
  // Over `members` (ranks of the world's group, ascending: this communicator's rank order; this
  // rank, `world_rank`, among them), with `streams` and `host` made for them by `make_group`, which
  // the splits use too; `hosts`: each member's host.
  ProcessGroupCommunicator(std::shared_ptr<GroupMaker> make_group, std::vector<int> members, int world_rank,
                           Group streams, Group host, Device& device, std::chrono::milliseconds timeout,
                           std::vector<int> hosts)
      : make_group_(std::move(make_group)), members_(std::move(members)), streams_(std::move(streams)),
        host_(std::move(host)), device_(device), timeout_(timeout), hosts_(std::move(hosts)),
        rank_(static_cast<int>(std::find(members_.begin(), members_.end(), world_rank) - members_.begin())),
        size_(static_cast<int>(members_.size())) {
    if (!device.host_accessible())
      throw CommError("the torch.distributed communicator moves host memory, but the device is " + device.name() +
                      ": a cuda device takes zest's NCCL communicator (comm.backend auto or nccl)");
    if (timeout.count() < 0)
      throw CommError("torch.distributed communicator: the timeout is negative (" + std::to_string(timeout.count()) +
                      " ms); pass 0 to wait forever");
    if (!streams_ || !host_)
      throw CommError("zest::torch: the group maker gave no group to a rank of the ranks it was asked for");
    try {
      (void)streams_->getBackend(c10::DeviceType::CPU);
    } catch (const std::exception&) {
      throw CommError("zest::torch: the torch.distributed group (backend " + streams_->getBackendName() +
                      ") has no backend for cpu tensors, which zest's cpu device needs: "
                      "init_process_group(\"gloo\") (or \"cpu:gloo,cuda:nccl\"), or move the model to the GPU");
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "torch.distributed(" + streams_->getBackendName() + ")"; }
  int host_of(int rank) const override { return host_in(hosts_, rank); }

  std::unique_ptr<Communicator> split_by_host() override {
    return split([this](int r) { return host_of(r); });
  }

  // Ranked by host: ascending rank order is host order, since hosts are numbered by lowest rank.
  std::unique_ptr<Communicator> split_across_hosts() override {
    return split([this](int r) { return place_on_host(r); });
  }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override {
    enqueue(all_reduce_call(send, recv, count, dtype, op), stream);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                      Stream& stream) override {
    enqueue(reduce_scatter_call(send, recv, recv_count, dtype, op, rank_, size_), stream);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, Stream& stream) override {
    enqueue(all_gather_call(send, recv, send_count, dtype, rank_, size_), stream);
  }
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override {
    enqueue(all_to_all_call(send, recv, count, dtype, size_), stream);
  }
  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override {
    enqueue(broadcast_call(buffer, count, dtype, root, size_), stream);
  }

  void barrier() override {
    check_usable();
    wait(host_->barrier(), "barrier");
  }
  void all_reduce_host(std::span<double> values, ReduceOp op) override {
    run_host(host_all_reduce_call(CollectiveKind::all_reduce_host_double, values.data(), values.size(), op),
             at::kDouble);
  }
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) override {
    run_host(host_all_reduce_call(CollectiveKind::all_reduce_host_int64, values.data(), values.size(), op),
             at::kLong);
  }

 private:
  // A communicator over the ranks sharing this rank's `colour`. Every rank makes the groups of
  // every colour, in colour order (as dist.new_group must be called), and keeps its own.
  template <class Colour>
  std::unique_ptr<Communicator> split(Colour colour) {
    std::map<int, std::vector<int>> by_colour;  // colour -> its ranks of the world's group
    for (int r = 0; r < size_; ++r) by_colour[colour(r)].push_back(members_[static_cast<std::size_t>(r)]);
    const int world_rank = members_[static_cast<std::size_t>(rank_)];
    std::vector<int> mine;
    Group streams, host;
    for (const auto& [c, ranks] : by_colour) {
      Group made_streams = (*make_group_)(ranks), made_host = (*make_group_)(ranks);
      if (c == colour(rank_)) {
        mine = ranks;
        streams = std::move(made_streams);
        host = std::move(made_host);
      }
    }
    std::vector<int> hosts;
    std::map<int, int> number;  // hosts numbered again from 0 in the new rank order (host_of)
    for (int r = 0; r < size_; ++r)
      if (colour(r) == colour(rank_))
        hosts.push_back(number.emplace(host_of(r), static_cast<int>(number.size())).first->second);
    return std::make_unique<ProcessGroupCommunicator>(make_group_, std::move(mine), world_rank, std::move(streams),
                                                      std::move(host), device_, timeout_, std::move(hosts));
  }

  static std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

  void check_usable() const {
    if (broken_.load()) throw CommError(broken_reason());
  }
  std::string broken_reason() const {
    std::lock_guard lock(broken_mutex_);
    return "torch.distributed communicator: unusable after an earlier failure (" + broken_what_ +
           "); end the process and restart from the last checkpoint";
  }

  // Waits for `work` within the timeout; a failure or a timeout leaves the communicator unusable.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    const std::uint64_t number = ++operations_;
    try {
      if (timeout_.count() > 0) {
        work->wait(timeout_);
      } else {
        work->wait();
      }
      return;
    } catch (const std::exception& e) {
      const std::string reason = what + " (zest's collective number " + std::to_string(number) + " on rank " +
                                 std::to_string(rank_) + ") failed or did not complete within comm.timeout " +
                                 std::to_string(timeout_.count()) + " ms: " + first_line(e.what());
      {
        std::lock_guard lock(broken_mutex_);
        if (broken_what_.empty()) broken_what_ = reason;
      }
      broken_.store(true);
      throw CommError(reason + " (a rank died, hangs, or issued other collectives; the group is unusable now)");
    }
  }

  void agree(const Group& group, const CollectiveCall& call, bool stream_failed, AgreementValues& values) {
    values = agreement_values(call, rank_, stream_failed);
    std::vector<at::Tensor> tensors{host_tensor(values.data(), values.size(), at::kLong)};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    wait(group->allreduce(tensors, options), std::string(collective_kind_name(call.kind)) + " (agreement)");
    check_agreement(call, values.data());
  }

  void enqueue(CollectiveCall call, Stream& stream) {
    // In lockstep: a rank whose stream already failed still reaches the agreement, so that every
    // rank raises instead of waiting for it.
    stream.lockstep_task([this, call = std::move(call)](bool stream_failed) { run(call, stream_failed); });
  }

  void run(const CollectiveCall& call, bool stream_failed) {
    check_usable();
    agree(streams_, call, stream_failed, stream_agreement_);
    if (call.count == 0) return;
    const at::ScalarType type = scalar_type(call.dtype);
    const std::size_t n = static_cast<std::size_t>(size_) * call.count;
    const std::string what = collective_kind_name(call.kind);
    switch (call.kind) {
      case CollectiveKind::all_reduce: {
        if (call.send != call.recv) std::memcpy(call.recv, call.send, call.count * dtype_size(call.dtype));
        std::vector<at::Tensor> tensors{host_tensor(call.recv, call.count, type)};
        c10d::AllreduceOptions options;
        options.reduceOp = reduce_op(call.op);
        wait(streams_->allreduce(tensors, options), what);
        break;
      }
      case CollectiveKind::reduce_scatter: {
        at::Tensor out = host_tensor(call.recv, call.count, type), in = host_tensor(call.send, n, type);
        c10d::ReduceScatterOptions options;
        options.reduceOp = reduce_op(call.op);
        wait(streams_->_reduce_scatter_base(out, in, options), what);
        break;
      }
      case CollectiveKind::all_gather: {
        at::Tensor out = host_tensor(call.recv, n, type), in = host_tensor(call.send, call.count, type);
        wait(streams_->_allgather_base(out, in), what);
        break;
      }
      case CollectiveKind::all_to_all: {
        at::Tensor out = host_tensor(call.recv, n, type), in = host_tensor(call.send, n, type);
        std::vector<std::int64_t> even;  // empty: equal blocks
        wait(streams_->alltoall_base(out, in, even, even), what);
        break;
      }
      case CollectiveKind::broadcast: {
        std::vector<at::Tensor> tensors{host_tensor(call.recv, call.count, type)};
        c10d::BroadcastOptions options;
        options.rootRank = call.root;
        wait(streams_->broadcast(tensors, options), what);
        break;
      }
      case CollectiveKind::all_reduce_host_double:
      case CollectiveKind::all_reduce_host_int64:
        break;  // never enqueued: run_host runs them on the caller's thread
    }
  }

  // On the caller's thread, over the host group, as barrier().
  void run_host(const CollectiveCall& call, at::ScalarType type) {
    check_usable();
    agree(host_, call, false, host_agreement_);
    if (call.count == 0) return;
    std::vector<at::Tensor> tensors{host_tensor(call.recv, call.count, type)};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(call.op);
    wait(host_->allreduce(tensors, options), collective_kind_name(call.kind));
  }

  std::shared_ptr<GroupMaker> make_group_;
  std::vector<int> members_;  // ranks of the world's group
  Group streams_;  // the stream workers' collectives
  Group host_;     // barrier and all_reduce_host, from the caller's thread
  Device& device_;
  std::chrono::milliseconds timeout_;
  std::vector<int> hosts_;
  int rank_;
  int size_;
  std::atomic<std::uint64_t> operations_{0};
  std::atomic<bool> broken_{false};
  mutable std::mutex broken_mutex_;
  std::string broken_what_;
  // One per thread that agrees; kept past a timeout, when the group may still write them.
  AgreementValues stream_agreement_{};
  AgreementValues host_agreement_{};
};

class ProcessGroupWorld final : public World {
 public:
  ProcessGroupWorld(Group group, std::chrono::milliseconds timeout, GroupMaker make_group)
      : group_(std::move(group)), timeout_(timeout) {
    if (!group_) throw Error("zest::torch: the process group is null; give an initialised torch.distributed group");
    make_group_ = std::make_shared<GroupMaker>(make_group ? std::move(make_group) : split_groups(group_));
    prefix_ = "zest/world" + std::to_string(next_serial(group_));
    store_ = group_->getStore();
    if (!store_)
      throw Error("zest::torch: the torch.distributed group '" + group_name(group_) +
                  "' has no store (zest finds each rank's host through it): give a group made by "
                  "init_process_group or new_group");
    find_hosts();
  }

  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }

  std::unique_ptr<Communicator> make_host_communicator(Device& device, std::chrono::milliseconds timeout) override {
    std::vector<int> everyone(static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r) everyone[static_cast<std::size_t>(r)] = r;
    // Two groups, as MPI's communicator has two communicators: the stream worker's collectives
    // and the caller's host ones may be in flight at once, and a group matches them by issue order.
    Group streams = (*make_group_)(everyone), host = (*make_group_)(everyone);
    return std::make_unique<ProcessGroupCommunicator>(make_group_, std::move(everyone), rank(), std::move(streams),
                                                      std::move(host), device, timeout, hosts_);
  }

  std::unique_ptr<Communicator> make_nccl_communicator(Device& device, std::chrono::milliseconds timeout) override {
    const std::string key = prefix_ + "/nccl" + std::to_string(made_++);
    return zest::make_nccl_communicator(
        device, rank(), size(),
        [this, key](void* data, std::size_t bytes) {
          if (rank() == 0) {
            const auto* begin = static_cast<const std::uint8_t*>(data);
            store_->set(key, std::vector<std::uint8_t>(begin, begin + bytes));
            return;
          }
          const std::vector<std::uint8_t> got = get(key);
          if (got.size() != bytes)
            throw CommError("zest::torch: NCCL's id from rank 0 has " + std::to_string(got.size()) + " bytes, not " +
                            std::to_string(bytes) + " (a different zest build on rank 0?)");
          std::memcpy(data, got.data(), bytes);
        },
        timeout, hosts_);
  }

 private:
  std::vector<std::uint8_t> get(const std::string& key) {
    try {
      if (timeout_.count() > 0) store_->wait({key}, timeout_);
      return store_->get(key);
    } catch (const std::exception& e) {
      throw CommError("zest::torch: waiting for '" + key + "' in the torch.distributed group's store failed or "
                      "timed out (" + std::to_string(timeout_.count()) + " ms; a rank did not build its zest "
                      "optimizer, or died): " + std::string(e.what()).substr(0, 300));
    }
  }

  // Each rank publishes its host's identity; hosts are numbered in the order of their lowest rank.
  void find_hosts() {
    const std::string mine = host_identity();
    store_->set(prefix_ + "/host" + std::to_string(rank()), std::vector<std::uint8_t>(mine.begin(), mine.end()));
    std::map<std::string, int> number;
    for (int r = 0; r < size(); ++r) {
      const std::vector<std::uint8_t> got = get(prefix_ + "/host" + std::to_string(r));
      const std::string identity(got.begin(), got.end());
      hosts_.push_back(number.emplace(identity, static_cast<int>(number.size())).first->second);
    }
    for (int r = 0; r < size(); ++r) {
      if (hosts_[static_cast<std::size_t>(r)] != hosts_[static_cast<std::size_t>(rank())]) continue;
      if (r < rank()) ++local_rank_;
      ++local_size_;
    }
  }

  Group group_;
  std::shared_ptr<GroupMaker> make_group_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<int> hosts_;
  int local_rank_ = 0;
  int local_size_ = 0;
  int made_ = 0;  // communicators made over this world: each meets the others under its number
};

}  // namespace

std::shared_ptr<World> make_process_group_world(Group group, std::chrono::milliseconds timeout,
                                                GroupMaker make_group) {
  return std::make_shared<ProcessGroupWorld>(std::move(group), timeout, std::move(make_group));
}

}  // namespace zest::torch::detail
