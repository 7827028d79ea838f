// A communicator for unit tests whose collectives move nothing and whose host all-reduces leave the
// values as they are: rank `rank` of `size`, every rank on one host. A test derives from it and
// overrides only the calls it watches (and host_of or the splits where it needs hosts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "zest/communicator.hpp"

namespace zest::test {

class SilentCommunicator : public Communicator {
 public:
  SilentCommunicator(int rank, int size, std::string name) : rank_(rank), size_(size), name_(std::move(name)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return name_; }
  void all_reduce(const void*, void*, std::size_t, DType, ReduceOp, Stream&) override {}
  void reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Stream&) override {}
  void all_gather(const void*, void*, std::size_t, DType, Stream&) override {}
  void all_to_all(const void*, void*, std::size_t, DType, Stream&) override {}
  void broadcast(void*, std::size_t, DType, int, Stream&) override {}
  void barrier() override {}
  void all_reduce_host(std::span<double>, ReduceOp) override {}
  void all_reduce_host(std::span<std::int64_t>, ReduceOp) override {}

 private:
  int rank_;
  int size_;
  std::string name_;
};

}  // namespace zest::test
