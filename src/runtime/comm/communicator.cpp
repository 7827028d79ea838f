#include "zest/communicator.hpp"

#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {

// The interface's default, for backends that cannot split (the world of one's, a program's own).
std::unique_ptr<Communicator> Communicator::split_by_host() {
  throw CommError("the " + backend_name() +
                  " communicator cannot make a communicator over one host; use the mpi or nccl backend, or "
                  "partition.secondary: none");
}

std::unique_ptr<Communicator> Communicator::split_across_hosts() {
  throw CommError("the " + backend_name() +
                  " communicator cannot make a communicator across hosts; use the mpi or nccl backend, or "
                  "comm.quantize.grads: none");
}

void Communicator::all_to_all(const void*, void*, std::size_t, DType, Stream&) {
  throw CommError("the " + backend_name() +
                  " communicator has no all_to_all, which comm.quantize.grads needs; implement it, use the mpi or nccl "
                  "backend, or set comm.quantize.grads: none");
}

int Communicator::host_in(std::span<const int> hosts, int rank) const {
  if (rank < 0 || rank >= size())
    throw CommError(
        fmt::format("host_of: rank {} is not one of the communicator's {} ranks (0 to size() - 1)", rank, size()));
  return hosts.empty() ? 0 : hosts[static_cast<std::size_t>(rank)];
}

int Communicator::place_on_host(int rank) const {
  const int host = host_of(rank);
  int place = 0;
  for (int r = 0; r < rank; ++r)
    if (host_of(r) == host) ++place;
  return place;
}

}  // namespace zest
