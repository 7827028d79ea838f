// Communicator: collectives across the data-parallel ranks, on device buffers, ordered on a stream.
//
// Two backends: MPI (cpu device; nonblocking MPI_I* collectives driven from the stream's worker)
// and NCCL (cuda device; bootstrapped over MPI). Every collective is enqueued on `stream` and
// returns at once; observe completion with an Event or Stream::synchronize(). Buffers belong to the
// communicator's device and must stay alive until completion. Every rank must issue the same
// collectives in the same order with the same counts; where a backend can detect a mismatch it
// throws CommError naming the ranks and counts instead of hanging.
#pragma once

#include <cstddef>
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
};

}  // namespace zest
