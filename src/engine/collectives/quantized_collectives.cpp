#include "engine/collectives/quantized_collectives.hpp"

#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::engine {
namespace {

using optim::QuantBits;
using optim::quantized_bytes;

// Codes cross the communicators as fp32 words: records are 4-byte multiples, and the collectives
// used here (all-gather, all-to-all) only move them.
std::size_t words(std::size_t bytes) { return bytes / sizeof(float); }

char* at(const DeviceBuffer& buffer, std::size_t bytes) { return buffer.as<char>() + bytes; }

}  // namespace

QuantizedGather::QuantizedGather(Device& device, Communicator& comm, DeviceMath& math, const GatherPlan& plan,
                                 DType dtype)
    : comm_(comm),
      math_(math),
      dtype_(dtype),
      capacity_(plan.quant_gather_codes),
      codes_(device.allocate(plan.quant_gather_codes, MemoryCategory::buffers)) {}

void QuantizedGather::all_gather(const void* own, void* full, std::size_t shard, Stream& stream) {
  const std::size_t record = quantized_bytes(QuantBits::int8, shard);
  const auto ranks = static_cast<std::size_t>(comm_.size());
  if (ranks * record > capacity_)
    throw Error(fmt::format("QuantizedGather: a shard of {} elements needs more codes than the plan holds", shard));
  char* const mine = at(codes_, static_cast<std::size_t>(comm_.rank()) * record);
  math_.quantize(own, dtype_, shard, QuantBits::int8, mine, stream);
  comm_.all_gather(mine, codes_.data(), words(record), DType::f32, stream);
  math_.dequantize_pieces(codes_.data(), QuantBits::int8, shard, ranks, full, dtype_, stream);
}

QuantizedReduceScatter::QuantizedReduceScatter(Device& device, Communicator& world, Communicator& host,
                                               Communicator* across, DeviceMath& math, const ReducePlan& plan,
                                               QuantBits bits, DType dtype)
    : host_(host),
      across_(across),
      math_(math),
      bits_(bits),
      dtype_(dtype),
      hosts_(across ? static_cast<std::size_t>(across->size()) : 1),
      per_host_(static_cast<std::size_t>(host.size())),
      capacity_(plan.quant_reduce_piece) {
  // The world's ranks by host and place: host k's ranks in world order, k numbered as host_of does.
  rank_at_.assign(hosts_ * per_host_, -1);
  std::vector<std::size_t> placed(hosts_, 0);
  bool fits = hosts_ * per_host_ == static_cast<std::size_t>(world.size());
  for (int r = 0; fits && r < world.size(); ++r) {
    const auto k = static_cast<std::size_t>(world.host_of(r));
    fits = k < hosts_ && placed[k] < per_host_;
    if (fits) rank_at_[k * per_host_ + placed[k]++] = r;
  }
  const auto me = static_cast<std::size_t>(world.host_of(world.rank()));
  if (!fits || rank_at_[me * per_host_ + static_cast<std::size_t>(host.rank())] != world.rank() ||
      (across && static_cast<std::size_t>(across->rank()) != me))
    throw Error(
        fmt::format("comm.quantize.grads needs as many ranks on every host, and the host ({} ranks) and across-host "
                    "({} ranks) communicators to cover the {} ranks; start the same number of ranks on each host, or "
                    "set comm.quantize.grads: none",
                    per_host_, hosts_, world.size()));
  // Record j * hosts_ + k of the host's all-to-all: place j's rank on host k's piece.
  host_order_.resize(hosts_ * per_host_);
  for (std::size_t j = 0; j < per_host_; ++j)
    for (std::size_t k = 0; k < hosts_; ++k)
      host_order_[j * hosts_ + k] = static_cast<std::size_t>(rank_at_[k * per_host_ + j]);
  for (std::size_t k = 0; k < hosts_; ++k) across_order_.push_back(k);
  send_codes_ = device.allocate(plan.quant_reduce_codes, MemoryCategory::buffers);
  recv_codes_ = device.allocate(plan.quant_reduce_codes, MemoryCategory::buffers);
  sums_ = device.allocate(plan.quant_reduce_sums, MemoryCategory::buffers);
}

void QuantizedReduceScatter::reduce_scatter(const void* send, void* recv, std::size_t piece, Stream& stream) {
  if (piece > capacity_)
    throw Error(
        fmt::format("QuantizedReduceScatter: a piece of {} elements is larger than the planned {}", piece, capacity_));
  const std::size_t record = quantized_bytes(bits_, piece);
  auto* const sums = sums_.as<float>();
  const std::size_t ranks = rank_at_.size();
  // Inside the host: place j's chunk holds the pieces of every host's j-th rank, in host order.
  math_.quantize_pieces(send, dtype_, piece, ranks, host_order_, bits_, send_codes_.data(), stream);
  host_.all_to_all(send_codes_.data(), recv_codes_.data(), words(hosts_ * record), DType::f32, stream);
  // The host's sum of each host's piece for this rank's place: record j * hosts_ + k is peer j's
  // code of host k's piece, so sum k adds places 0, 1, ... in order.
  math_.dequantize_sum(recv_codes_.data(), bits_, piece, hosts_, per_host_, sums, stream);
  if (hosts_ > 1) {
    // Across hosts: host k's sum goes to the rank of this place on host k; the sums that arrive are
    // every host's sum of this rank's piece.
    math_.quantize_pieces(sums, DType::f32, piece, hosts_, across_order_, bits_, send_codes_.data(), stream);
    across_->all_to_all(send_codes_.data(), recv_codes_.data(), words(record), DType::f32, stream);
    math_.dequantize_sum(recv_codes_.data(), bits_, piece, 1, hosts_, sums, stream);
  }
  math_.cast_from_f32(sums, piece, recv, dtype_, stream);
}

}  // namespace zest::engine
