// Test communicators for the engine's multi-rank tests: one that passes every call to another
// (the base the others change what they need of), and MPI's world cut into simulated hosts of a
// few ranks each, as real hosts would be: host_of says so, split_by_host gives an MPI communicator
// over each host's ranks, split_across_hosts one over the ranks of a place on every host, whose
// peers are all on other hosts.
#pragma once

#include <mpi.h>

#include <memory>
#include <span>
#include <string>

#include "runtime/comm/mpi_communicator.hpp"
#include "zest/communicator.hpp"

namespace zest::test_hosts {

class Forwarding : public Communicator {
 public:
  explicit Forwarding(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend_name() const override { return inner_.backend_name(); }
  int host_of(int rank) const override { return inner_.host_of(rank); }
  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream& stream) override {
    inner_.all_reduce(send, recv, count, dtype, op, stream);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                      Stream& stream) override {
    inner_.reduce_scatter(send, recv, recv_count, dtype, op, stream);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, Stream& stream) override {
    inner_.all_gather(send, recv, send_count, dtype, stream);
  }
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override {
    inner_.all_to_all(send, recv, count, dtype, stream);
  }
  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override {
    inner_.broadcast(buffer, count, dtype, root, stream);
  }
  void barrier() override { inner_.barrier(); }
  void all_reduce_host(std::span<double> values, ReduceOp op) override { inner_.all_reduce_host(values, op); }
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) override {
    inner_.all_reduce_host(values, op);
  }

 private:
  Communicator& inner_;
};

// An MPI communicator over part of the world whose ranks all sit on hosts of their own.
class EachOnItsHost final : public Forwarding {
 public:
  explicit EachOnItsHost(std::unique_ptr<Communicator> inner) : Forwarding(*inner), owned_(std::move(inner)) {}
  int host_of(int rank) const override { return rank; }

 private:
  std::unique_ptr<Communicator> owned_;
};

// The world on hosts of `per_host` consecutive ranks (0..per_host-1, ...), or, with `first_alone`,
// rank 0 on a host of its own and every other rank on another (hosts of unequal size).
class SimulatedHosts final : public Forwarding {
 public:
  // `world`: an MPI communicator over every rank, on `device`.
  SimulatedHosts(Communicator& world, Device& device, int per_host = 2, bool first_alone = false)
      : Forwarding(world), device_(device), per_host_(per_host), first_alone_(first_alone) {}
  std::string backend_name() const override { return "mpi (simulated hosts)"; }
  int host_of(int rank) const override { return first_alone_ ? (rank == 0 ? 0 : 1) : rank / per_host_; }
  std::unique_ptr<Communicator> split_by_host() override { return split(host_of(rank()), rank()); }
  std::unique_ptr<Communicator> split_across_hosts() override {
    return std::make_unique<EachOnItsHost>(split(rank() % per_host_, host_of(rank())));
  }

 private:
  std::unique_ptr<Communicator> split(int color, int key) {
    MPI_Comm part = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, color, key, &part);
    // As zest's own splits are made: no watchdog responder beside the world's.
    auto made = std::make_unique<MpiCommunicator>(part, device_, MpiCommunicator::kMaxChunkElements,
                                                  kDefaultCommTimeout, CollectiveWatchdog::Responder::none);
    MPI_Comm_free(&part);
    return made;
  }

  Device& device_;
  const int per_host_;
  const bool first_alone_;
};

}  // namespace zest::test_hosts
