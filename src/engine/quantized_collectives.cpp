#include "engine/quantized_collectives.hpp"

#include <string>

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

QuantizedGather::QuantizedGather(Device& device, Communicator& comm, DeviceMath& math, const MemoryPlan& plan,
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
    throw Error(std::string("QuantizedGather: a shard of ").append(std::to_string(shard))
                    .append(" elements needs more codes than the plan holds"));
  char* const mine = at(codes_, static_cast<std::size_t>(comm_.rank()) * record);
  math_.quantize(own, dtype_, shard, QuantBits::int8, mine, stream);
  comm_.all_gather(mine, codes_.data(), words(record), DType::f32, stream);
  const std::size_t shard_bytes = shard * dtype_size(dtype_);
  for (std::size_t r = 0; r < ranks; ++r)
    math_.dequantize(at(codes_, r * record), QuantBits::int8, shard, static_cast<char*>(full) + r * shard_bytes,
                     dtype_, stream);
}

QuantizedReduceScatter::QuantizedReduceScatter(Device& device, Communicator& world, Communicator& host,
                                               Communicator* across, DeviceMath& math, const MemoryPlan& plan,
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
    throw Error(std::string("comm.quantize.grads needs as many ranks on every host, and the host (")
                    .append(std::to_string(per_host_)).append(" ranks) and across-host (")
                    .append(std::to_string(hosts_)).append(" ranks) communicators to cover the ")
                    .append(std::to_string(world.size()))
                    .append(" ranks; start the same number of ranks on each host, or set comm.quantize.grads: none"));
  send_codes_ = device.allocate(plan.quant_reduce_codes, MemoryCategory::buffers);
  recv_codes_ = device.allocate(plan.quant_reduce_codes, MemoryCategory::buffers);
  sums_ = device.allocate(plan.quant_reduce_sums, MemoryCategory::buffers);
}

void QuantizedReduceScatter::reduce_scatter(const void* send, void* recv, std::size_t piece, Stream& stream) {
  if (piece > capacity_)
    throw Error(std::string("QuantizedReduceScatter: a piece of ").append(std::to_string(piece))
                    .append(" elements is larger than the planned ").append(std::to_string(capacity_)));
  const std::size_t record = quantized_bytes(bits_, piece);
  const std::size_t piece_bytes = piece * dtype_size(dtype_);
  auto* const sums = sums_.as<float>();
  // Inside the host: place j's chunk holds the pieces of every host's j-th rank, in host order.
  for (std::size_t j = 0; j < per_host_; ++j)
    for (std::size_t k = 0; k < hosts_; ++k)
      math_.quantize(static_cast<const char*>(send) + static_cast<std::size_t>(rank_at_[k * per_host_ + j]) * piece_bytes,
                     dtype_, piece, bits_, at(send_codes_, (j * hosts_ + k) * record), stream);
  host_.all_to_all(send_codes_.data(), recv_codes_.data(), words(hosts_ * record), DType::f32, stream);
  // The host's sum of each host's piece for this rank's place: from every peer, in place order.
  for (std::size_t j = 0; j < per_host_; ++j)
    for (std::size_t k = 0; k < hosts_; ++k) {
      const char* const codes = at(recv_codes_, (j * hosts_ + k) * record);
      if (j == 0) math_.dequantize(codes, bits_, piece, sums + k * piece, DType::f32, stream);
      else math_.dequantize_add(codes, bits_, piece, sums + k * piece, stream);
    }
  if (hosts_ > 1) {
    // Across hosts: host k's sum goes to the rank of this place on host k; the sums that arrive are
    // every host's sum of this rank's piece.
    for (std::size_t k = 0; k < hosts_; ++k)
      math_.quantize(sums + k * piece, DType::f32, piece, bits_, at(send_codes_, k * record), stream);
    across_->all_to_all(send_codes_.data(), recv_codes_.data(), words(record), DType::f32, stream);
    for (std::size_t k = 0; k < hosts_; ++k) {
      const char* const codes = at(recv_codes_, k * record);
      if (k == 0) math_.dequantize(codes, bits_, piece, sums, DType::f32, stream);
      else math_.dequantize_add(codes, bits_, piece, sums, stream);
    }
  }
  math_.cast_from_f32(sums, piece, recv, dtype_, stream);
}

}  // namespace zest::engine
