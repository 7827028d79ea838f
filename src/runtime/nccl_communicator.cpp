// NCCL collectives on the caller's CUDA streams, bootstrapped over the MPI world.
#include "runtime/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <exception>
#include <memory>
#include <string>

#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/mpi_check.hpp"
#include "runtime/mpi_session.hpp"
#include "runtime/nccl_check.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
  }
  throw CommError(std::string("nccl: unknown dtype ")
                      .append(std::to_string(static_cast<int>(dtype)))
                      .append("; pass fp32, fp16 or bf16"));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
  }
  throw CommError(std::string("nccl: unknown reduce op ")
                      .append(std::to_string(static_cast<int>(op)))
                      .append("; pass sum or max"));
}

// What rank 0 broadcasts: the id, or why it has none, so every rank fails together instead of
// the others waiting forever in MPI_Bcast for a rank that threw.
struct Bootstrap {
  ncclUniqueId id;
  int result;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MpiSession& session, int ordinal)
      : ordinal_(ordinal), world_(session.world()), rank_(session.rank()), size_(session.size()) {
    Bootstrap bootstrap{};
    if (rank_ == 0) bootstrap.result = static_cast<int>(ncclGetUniqueId(&bootstrap.id));
    ZEST_MPI_CHECK(MPI_Bcast(&bootstrap, static_cast<int>(sizeof bootstrap), MPI_BYTE, 0, world_));
    if (bootstrap.result != static_cast<int>(ncclSuccess)) {
      const auto code = static_cast<ncclResult_t>(bootstrap.result);
      throw CommError(std::string("ncclGetUniqueId failed on rank 0: ")
                          .append(ncclGetErrorString(code))
                          .append("; check rank 0's network interfaces (NCCL_SOCKET_IFNAME) and "
                                  "run with NCCL_DEBUG=WARN for NCCL's reason"));
    }
    // NCCL binds the communicator to the current device.
    ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
    try {
      ZEST_NCCL_CHECK(ncclCommInitRank(&comm_, size_, bootstrap.id, rank_));
    } catch (const CommError& error) {
      throw CommError(std::string("starting NCCL for rank ")
                          .append(std::to_string(rank_))
                          .append(" of ")
                          .append(std::to_string(size_))
                          .append(" on cuda:")
                          .append(std::to_string(ordinal_))
                          .append(": ")
                          .append(error.what())
                          .append("; each rank needs its own GPU (start one rank per GPU), and "
                                  "NCCL_DEBUG=INFO shows where the bootstrap stopped"));
    }
  }

  ~NcclCommunicator() override {
    static_cast<void>(cudaSetDevice(ordinal_));
    ncclResult_t async_error = ncclSuccess;
    const bool broken = ncclCommGetAsyncError(comm_, &async_error) != ncclSuccess ||
                        async_error != ncclSuccess;
    // ncclCommDestroy flushes this rank's outstanding collectives, which never finish when a peer
    // failed or this rank is unwinding from an error between collectives; abort never blocks.
    if (broken || std::uncaught_exceptions() > 0) {
      static_cast<void>(ncclCommAbort(comm_));
    } else {
      static_cast<void>(ncclCommDestroy(comm_));
    }
  }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override {
    const cudaStream_t handle = prepare(stream);
    ZEST_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, handle));
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override {
    const cudaStream_t handle = prepare(stream);
    ZEST_NCCL_CHECK(
        ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), nccl_op(op), comm_, handle));
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                  Stream& stream) override {
    const cudaStream_t handle = prepare(stream);
    ZEST_NCCL_CHECK(ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, handle));
  }

  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override {
    if (root < 0 || root >= size_) {
      throw CommError(std::string("broadcast: root ")
                          .append(std::to_string(root))
                          .append(" is not a rank of this world of ")
                          .append(std::to_string(size_))
                          .append("; pass a root in [0, size())"));
    }
    const cudaStream_t handle = prepare(stream);
    ZEST_NCCL_CHECK(ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, handle));
  }

  // A host-side barrier: MPI_Barrier on zest's world blocks exactly the calling threads, without
  // a device buffer or a stream of its own.
  void barrier() override {
    check_async_error();
    ZEST_MPI_CHECK(MPI_Barrier(world_));
  }

 private:
  cudaStream_t prepare(Stream& stream) {
    const cudaStream_t handle = cuda_stream_handle(stream);
    check_async_error();
    // NCCL launches its kernels on the current device.
    ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
    return handle;
  }

  // A failure inside NCCL's own threads (a peer died, the network broke) is reported here, before
  // the next collective would wait for it forever.
  void check_async_error() {
    ncclResult_t async_error = ncclSuccess;
    ZEST_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async_error));
    if (async_error != ncclSuccess) {
      throw CommError(std::string("NCCL reported an asynchronous failure on rank ")
                          .append(std::to_string(rank_))
                          .append(": ")
                          .append(ncclGetErrorString(async_error))
                          .append(" (")
                          .append(ncclGetLastError(comm_))
                          .append("); a peer rank or the network failed, see that rank's error, "
                                  "and rerun with NCCL_DEBUG=WARN"));
    }
  }

  int ordinal_;
  MPI_Comm world_;
  int rank_;
  int size_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MpiSession& session, Device& device) {
  const int ordinal = cuda_device_ordinal(device);
  if (ordinal < 0) {
    throw CommError(std::string("the nccl communicator needs a cuda device, but the device is ")
                        .append(device.name())
                        .append("; set device.type: cuda, or comm.backend: mpi (or auto) for a "
                                "cpu device"));
  }
  return std::make_unique<NcclCommunicator>(session, ordinal);
}

}  // namespace zest
