#include "runtime/comm/counting_communicator.hpp"

namespace zest {

CountingCommunicator::CountingCommunicator(Communicator& inner) : inner_(inner) {
  const int me = inner.host_of(inner.rank());
  for (int r = 0; r < inner.size(); ++r) {
    if (r == inner.rank()) continue;
    (inner.host_of(r) == me ? peers_inside_ : peers_across_) += 1;
  }
}

WireBytes CountingCommunicator::sent() const {
  WireBytes w;
  for (std::size_t i = 0; i < kCollectiveKinds; ++i) {
    w.inside_host[i] = inside_[i].load(std::memory_order_relaxed);
    w.across_hosts[i] = across_[i].load(std::memory_order_relaxed);
  }
  return w;
}

void CountingCommunicator::to_every_peer(Collective c, std::uint64_t bytes) {
  const auto i = static_cast<std::size_t>(c);
  inside_[i].fetch_add(bytes * static_cast<std::uint64_t>(peers_inside_), std::memory_order_relaxed);
  across_[i].fetch_add(bytes * static_cast<std::uint64_t>(peers_across_), std::memory_order_relaxed);
}

void CountingCommunicator::all_reduce_of(std::size_t count, std::size_t size) {
  const auto n = static_cast<std::size_t>(inner_.size());
  const std::size_t me = static_cast<std::size_t>(inner_.rank());
  auto block = [&](std::size_t r) { return count / n + (r < count % n ? 1 : 0); };
  const auto i = static_cast<std::size_t>(Collective::all_reduce);
  const int my_host = inner_.host_of(inner_.rank());
  std::uint64_t inside = 0, across = 0;
  for (std::size_t r = 0; r < n; ++r) {
    if (r == me) continue;
    // Rank r's block to r (reduce-scatter), then this rank's own block to r (all-gather).
    const std::uint64_t bytes = (block(r) + block(me)) * size;
    (inner_.host_of(static_cast<int>(r)) == my_host ? inside : across) += bytes;
  }
  inside_[i].fetch_add(inside, std::memory_order_relaxed);
  across_[i].fetch_add(across, std::memory_order_relaxed);
}

void CountingCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                                      Stream& stream) {
  inner_.all_reduce(send, recv, count, dtype, op, stream);
  all_reduce_of(count, dtype_size(dtype));
}

void CountingCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                                          ReduceOp op, Stream& stream) {
  inner_.reduce_scatter(send, recv, recv_count, dtype, op, stream);
  to_every_peer(Collective::reduce_scatter, recv_count * dtype_size(dtype));
}

void CountingCommunicator::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                                      Stream& stream) {
  inner_.all_gather(send, recv, send_count, dtype, stream);
  to_every_peer(Collective::all_gather, send_count * dtype_size(dtype));
}

void CountingCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                                      Stream& stream) {
  inner_.all_to_all(send, recv, count, dtype, stream);
  to_every_peer(Collective::all_to_all, count * dtype_size(dtype));
}

void CountingCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) {
  inner_.broadcast(buffer, count, dtype, root, stream);
  if (root == inner_.rank()) to_every_peer(Collective::broadcast, count * dtype_size(dtype));
}

void CountingCommunicator::all_reduce_host(std::span<double> values, ReduceOp op) {
  inner_.all_reduce_host(values, op);
  all_reduce_of(values.size(), sizeof(double));
}

void CountingCommunicator::all_reduce_host(std::span<std::int64_t> values, ReduceOp op) {
  inner_.all_reduce_host(values, op);
  all_reduce_of(values.size(), sizeof(std::int64_t));
}

}  // namespace zest
