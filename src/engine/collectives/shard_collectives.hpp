// The collectives over a group's shards, each way of crossing the wire an object of its own, chosen
// once when the engine is built (as FSDP2 holds its collectives): the gather of every rank's shard,
// exact (ExactGather) or as qwZ's int8 codes (QuantizedGather), and the reduce-scatter of a
// bucket, exact (ExactReduceScatter) or as qgZ's codes over two levels (QuantizedReduceScatter,
// quantized_collectives.hpp). ParamGather and GradBuckets hold one each and never ask which.
// Threading: the engine's host thread; the work runs on the stream given.
#pragma once

#include <cstddef>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest::engine {

class ShardGather {
 public:
  virtual ~ShardGather() = default;
  // full = the ranks' shards of `shard` elements of the working dtype, rank r's at block r; `own`
  // is this rank's (it may be full's block rank(): in place).
  virtual void all_gather(const void* own, void* full, std::size_t shard, Stream& stream) = 0;
};

class ShardReduceScatter {
 public:
  virtual ~ShardReduceScatter() = default;
  // send: one piece of `piece` elements of the working dtype per rank, rank-major; recv: `piece`
  // elements, the sum over ranks of this rank's piece. recv may be send's block rank().
  virtual void reduce_scatter(const void* send, void* recv, std::size_t piece, Stream& stream) = 0;
};

// The communicator's own collectives, in the working dtype. `comm` must outlive this.
class ExactGather final : public ShardGather {
 public:
  ExactGather(Communicator& comm, DType dtype) : comm_(comm), dtype_(dtype) {}
  void all_gather(const void* own, void* full, std::size_t shard, Stream& stream) override {
    comm_.all_gather(own, full, shard, dtype_, stream);
  }

 private:
  Communicator& comm_;
  const DType dtype_;
};

class ExactReduceScatter final : public ShardReduceScatter {
 public:
  ExactReduceScatter(Communicator& comm, DType dtype) : comm_(comm), dtype_(dtype) {}
  void reduce_scatter(const void* send, void* recv, std::size_t piece, Stream& stream) override {
    comm_.reduce_scatter(send, recv, piece, dtype_, ReduceOp::sum, stream);
  }

 private:
  Communicator& comm_;
  const DType dtype_;
};

}  // namespace zest::engine
