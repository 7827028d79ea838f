// The MPI world: ranks from MPI_COMM_WORLD (through MpiSession), NCCL's unique id over MPI.
#include <mpi.h>

#include <memory>

#include "runtime/comm/mpi_check.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "runtime/comm/nccl_communicator.hpp"
#include "runtime/comm/world.hpp"

namespace zest {
namespace {

class MpiWorld final : public World {
 public:
  int rank() const override { return session_.rank(); }
  int size() const override { return session_.size(); }
  int local_rank() const override { return session_.local_rank(); }
  int local_size() const override { return session_.local_size(); }

  std::unique_ptr<Communicator> make_host_communicator(Device& device, std::chrono::milliseconds timeout) override {
    return make_mpi_communicator(session_, device, timeout);
  }

  std::unique_ptr<Communicator> make_nccl_communicator(Device& device, std::chrono::milliseconds timeout) override {
    MPI_Comm world = session_.world();
    return zest::make_nccl_communicator(device, session_.rank(), session_.size(),
                                        [world](void* data, std::size_t bytes) {
                                          ZEST_MPI_CHECK(MPI_Bcast(data, static_cast<int>(bytes),
                                                                   MPI_BYTE, 0, world));
                                        },
                                        timeout, host_numbers(world));
  }

 private:
  MpiSession session_;
};

}  // namespace

std::unique_ptr<World> make_world() { return std::make_unique<MpiWorld>(); }

}  // namespace zest
