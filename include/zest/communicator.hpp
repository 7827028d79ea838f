// Communicator: collectives across the data-parallel ranks, on device buffers, ordered on a stream.
//
// Backends: MPI (cpu device; nonblocking MPI_I* collectives driven from the stream's worker), NCCL
// (cuda device; its id carried over MPI, or one rank without MPI) and, in builds without MPI, the
// local communicator of a world of one (any device; collectives are copies). A communicator over a
// communicator the program already has: zest/mpi.hpp (MPI_Comm), zest/nccl.hpp (ncclComm_t). Every collective is enqueued on `stream` and
// returns at once; observe completion with an Event or Stream::synchronize(). Buffers belong to the
// communicator's device and must stay alive until completion. Every rank must issue the same
// collectives in the same order with the same counts; where a backend can detect a mismatch it
// throws CommError naming the ranks and counts instead of hanging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "zest/device.hpp"
#include "zest/dtype.hpp"

namespace zest {

enum class ReduceOp { sum, max };

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;

  // recv[i] = op over ranks of send[i]. In place when send == recv.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                          Stream& stream) = 0;
  // send holds size() * recv_count elements; rank r receives op over ranks of block r.
  // In place when recv == send + rank() * recv_count elements (the rank's own block).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              ReduceOp op, Stream& stream) = 0;
  // recv holds size() * send_count elements; block r comes from rank r.
  // In place when send == recv + rank() * send_count elements.
  virtual void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                          Stream& stream) = 0;
  // Every rank's buffer becomes root's.
  virtual void broadcast(void* buffer, std::size_t count, DType dtype, int root,
                         Stream& stream) = 0;
  // Blocks the calling host thread until every rank has called barrier().
  virtual void barrier() = 0;

  // Host scalars for the trainer (a loss, token counts): values[i] = op over ranks of values[i],
  // in place, in host memory. Blocks the calling thread until done; needs no stream and no device
  // buffer (the communicator keeps the little its backend needs). Collective: every rank calls it
  // with the same count and op; mismatches raise CommError where the backend can tell (MPI).
  // Host collectives (barrier, all_reduce_host) go from one thread at a time, in the same order
  // on every rank; they do not wait for the stream collectives.
  virtual void all_reduce_host(std::span<double> values, ReduceOp op) = 0;
  virtual void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) = 0;
};

}  // namespace zest
