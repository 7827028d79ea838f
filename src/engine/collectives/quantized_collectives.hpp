// Quantized collectives (config comm.quantize), ZeRO++'s two: the parameter all-gather with int8
// codes (qwZ) and the gradient reduce-scatter as two all-to-alls of int8 or int4 codes, inside each
// host and then across hosts (qgZ). The codec is the device math's block quantizer (one fp32 scale
// per 256 elements; optim/block_quant_math.hpp), so the result is the same bits on every backend.
//
// Each call enqueues its work on the comm stream and returns. The code and sum buffers (sizes from
// the MemoryPlan) serve one collective at a time: the stream runs them in order, so the next call's
// quantization starts only after the previous call has read its codes.
// Threading: the engine's host thread.
#pragma once

#include <cstddef>
#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/collectives/shard_collectives.hpp"
#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest::engine {

// qwZ: every rank's shard crosses the wire as int8 records; every rank decodes all of them, its own
// too, so the ranks compute with the same parameters.
class QuantizedGather final : public ShardGather {
 public:
  // The codes of plan.quant_gather_codes bytes: every rank's records of the largest shard.
  QuantizedGather(Device& device, Communicator& comm, DeviceMath& math, const GatherPlan& plan, DType dtype);

  // full = comm.size() shards of `shard` elements of the working dtype, block r rank r's `own`
  // decoded. `own` may be full's block rank() (in place).
  void all_gather(const void* own, void* full, std::size_t shard, Stream& stream) override;

 private:
  Communicator& comm_;
  DeviceMath& math_;
  const DType dtype_;
  const std::size_t capacity_;  // bytes of codes_
  DeviceBuffer codes_;
};

// qgZ: a reduce-scatter whose ranks sit on H hosts of L ranks. Each rank quantizes the pieces of
// its buffer and sends every peer on its host the pieces of the ranks that hold that peer's place
// on their hosts (an all-to-all inside the host); it decodes and sums what it receives in fp32 (its
// host's sum of H pieces), quantizes those sums and sends each to the rank of its place on that
// piece's host (an all-to-all across hosts), then decodes and sums the H partial sums of its own
// piece in fp32. Across hosts a rank sends (H - 1) / H of one piece, where a reduce-scatter sends
// (H - 1) L / (H L) of the whole buffer: 1/L as much, at 8 or 4 bits an element.
class QuantizedReduceScatter final : public ShardReduceScatter {
 public:
  // `host`: this rank's host's ranks (Communicator::split_by_host), `across`: the ranks holding its
  // place on every host (split_across_hosts; null where there is one host); together over the
  // ranks of `world`, every host holding as many (Error otherwise). Buffers:
  // plan.quant_reduce_codes (twice) and plan.quant_reduce_sums.
  QuantizedReduceScatter(Device& device, Communicator& world, Communicator& host, Communicator* across,
                         DeviceMath& math, const ReducePlan& plan, optim::QuantBits bits, DType dtype);

  // send: world.size() pieces of `piece` elements of the working dtype, rank-major; recv: `piece`
  // elements, the sum over ranks of this rank's piece (formed in fp32 from the decoded codes,
  // rounded once to the dtype). recv may be send's block rank().
  void reduce_scatter(const void* send, void* recv, std::size_t piece, Stream& stream) override;

 private:
  Communicator& host_;
  Communicator* across_;
  DeviceMath& math_;
  const optim::QuantBits bits_;
  const DType dtype_;
  const std::size_t hosts_, per_host_;
  std::vector<int> rank_at_;  // [host * per_host_ + place]: the world rank
  // The pieces each all-to-all's records hold, in record order (quantize_pieces): inside the host,
  // record place * hosts_ + host is rank_at_[host * per_host_ + place]'s; across hosts, record k is
  // host k's sum.
  std::vector<std::size_t> host_order_, across_order_;
  const std::size_t capacity_;  // elements of one piece the buffers hold
  DeviceBuffer send_codes_, recv_codes_;
  DeviceBuffer sums_;  // fp32: the host's sums of hosts_ pieces, then the sum of this rank's
};

}  // namespace zest::engine
