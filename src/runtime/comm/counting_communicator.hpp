// CountingCommunicator: another communicator's collectives, passed through unchanged and counted
// as the bytes this rank sends (zest::WireBytes), inside its host and across hosts
// (Communicator::host_of). The engine wraps the communicator it is given in one, so every
// collective of a step is counted whatever the backend, and the count is what the rank asked to
// send, not what a backend's algorithm routed where.
// Threading: the counts are atomic; any thread may call sent() while collectives are issued.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "zest/communicator.hpp"

namespace zest {

class CountingCommunicator final : public Communicator {
 public:
  // `inner` must outlive this.
  explicit CountingCommunicator(Communicator& inner);

  // Bytes sent since construction.
  WireBytes sent() const;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend_name() const override { return inner_.backend_name(); }
  int host_of(int rank) const override { return inner_.host_of(rank); }
  // The inner communicator's, not counted: count it with a CountingCommunicator of its own.
  std::unique_ptr<Communicator> split_by_host() override { return inner_.split_by_host(); }
  std::unique_ptr<Communicator> split_across_hosts() override { return inner_.split_across_hosts(); }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream& stream) override;
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                      Stream& stream) override;
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, Stream& stream) override;
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override;
  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override;
  void barrier() override { inner_.barrier(); }
  void all_reduce_host(std::span<double> values, ReduceOp op) override;
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) override;

 private:
  // Counts `bytes` sent to every other rank.
  void to_every_peer(Collective c, std::uint64_t bytes);
  // An all-reduce of `count` elements of `size` bytes: this rank sends every other rank that rank's
  // block (the reduce-scatter half), then its own block (the all-gather half); blocks as even as
  // `count` allows, the first count % n one element larger.
  void all_reduce_of(std::size_t count, std::size_t size);

  Communicator& inner_;
  int peers_inside_ = 0;   // other ranks on this rank's host
  int peers_across_ = 0;   // ranks on other hosts
  std::array<std::atomic<std::uint64_t>, kCollectiveKinds> inside_{};
  std::array<std::atomic<std::uint64_t>, kCollectiveKinds> across_{};
};

}  // namespace zest
