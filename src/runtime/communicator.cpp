#include "zest/communicator.hpp"

#include <string>

#include "zest/error.hpp"

namespace zest {

// The interface's default, for backends that cannot split (the world of one's, a program's own).
std::unique_ptr<Communicator> Communicator::split_by_host() {
  throw CommError("the " + backend_name() +
                  " communicator cannot make a communicator over one host; use the mpi or nccl backend, or "
                  "partition.secondary: none");
}

int Communicator::host_in(std::span<const int> hosts, int rank) const {
  if (rank < 0 || rank >= size())
    throw CommError("host_of: rank " + std::to_string(rank) + " is not one of the communicator's " +
                    std::to_string(size()) + " ranks (0 to size() - 1)");
  return hosts.empty() ? 0 : hosts[static_cast<std::size_t>(rank)];
}

}  // namespace zest
