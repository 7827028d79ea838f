// Communicator: collectives across the data-parallel ranks, on device buffers, ordered on a stream.
//
// Backends: MPI (cpu device; nonblocking MPI_I* collectives driven from the stream's worker), NCCL
// (cuda device; its id carried over MPI, or one rank without MPI) and, in builds without MPI, the
// local communicator of a world of one (any device; collectives are copies). A communicator over a
// communicator the program already has: zest/mpi.hpp (MPI_Comm), zest/nccl.hpp (ncclComm_t). Every collective is
// enqueued on `stream` and returns at once; observe completion with an Event or Stream::synchronize(). Buffers belong
// to the communicator's device and must stay alive until completion. Every rank must issue the same collectives in the
// same order with the same counts; where a backend can detect a mismatch it throws CommError naming the ranks and
// counts instead of hanging.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "zest/device.hpp"
#include "zest/dtype.hpp"

namespace zest {

enum class ReduceOp { sum, max };

// The collectives that move data, as WireBytes counts them.
enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all };
inline constexpr std::size_t kCollectiveKinds = 5;

// Bytes one rank sent, per collective, to ranks on its own host and to ranks on other hosts.
// Counted by what each rank must send (the pairwise model): a reduce-scatter sends every other rank
// its block, an all-gather sends every other rank this rank's block, an all-reduce is a
// reduce-scatter then an all-gather of the same buffer, a broadcast sends its root's buffer to every
// other rank, an all-to-all sends every other rank the block meant for it. Per rank that is (n-1)/n
// of the buffer per pass, as a ring moves; a backend's own algorithm (a tree, a hierarchical ring)
// may route the same data over other links.
struct WireBytes {
  std::array<std::uint64_t, kCollectiveKinds> inside_host{};
  std::array<std::uint64_t, kCollectiveKinds> across_hosts{};

  std::uint64_t inside() const { return sum(inside_host); }
  std::uint64_t across() const { return sum(across_hosts); }
  std::uint64_t total() const { return inside() + across(); }
  std::uint64_t of(Collective c) const {
    return inside_host[static_cast<std::size_t>(c)] + across_hosts[static_cast<std::size_t>(c)];
  }
  WireBytes operator+(const WireBytes& other) const {
    WireBytes s;
    for (std::size_t i = 0; i < kCollectiveKinds; ++i) {
      s.inside_host[i] = inside_host[i] + other.inside_host[i];
      s.across_hosts[i] = across_hosts[i] + other.across_hosts[i];
    }
    return s;
  }
  // What was sent between two readings of the counters (later - earlier).
  WireBytes operator-(const WireBytes& earlier) const {
    WireBytes d;
    for (std::size_t i = 0; i < kCollectiveKinds; ++i) {
      d.inside_host[i] = inside_host[i] - earlier.inside_host[i];
      d.across_hosts[i] = across_hosts[i] - earlier.across_hosts[i];
    }
    return d;
  }

 private:
  static std::uint64_t sum(const std::array<std::uint64_t, kCollectiveKinds>& a) {
    std::uint64_t n = 0;
    for (std::uint64_t x : a) n += x;
    return n;
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;
  // The host rank `rank` runs on, numbered from 0 in the order of each host's lowest rank: bytes to
  // a rank of another host cross the network. MPI knows (the ranks that share memory); every rank is
  // on host 0 where the backend cannot tell (a world of one, the program's own ncclComm_t).
  virtual int host_of(int rank) const {
    (void)rank;
    return 0;
  }
  // A new communicator over the ranks of this rank's host (host_of), in this communicator's rank
  // order, on the same device: collective over this communicator, like making one, and called while
  // none of its collectives is in flight. Throws CommError where the backend cannot make one.
  virtual std::unique_ptr<Communicator> split_by_host();
  // A new communicator over the ranks that hold this rank's place on their hosts (the i-th rank of
  // each host in this communicator's order, for this rank's i), ranked by host number (host_of):
  // with split_by_host, the two levels of a hierarchical collective. Collective like
  // split_by_host, with the same conditions; throws CommError where the backend cannot make one.
  virtual std::unique_ptr<Communicator> split_across_hosts();

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
  // send and recv hold size() * count elements each and do not overlap: block r of send goes to
  // rank r, block r of recv comes from rank r (its send's block rank()).
  // The default throws CommError (a communicator written before this existed); every zest backend
  // has one.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                          Stream& stream);
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

 protected:
  // host_of for a backend that keeps each rank's host in `hosts` (empty: all on host 0): throws
  // CommError for a rank outside 0..size() - 1.
  int host_in(std::span<const int> hosts, int rank) const;
  // `rank`'s index among the ranks of its host (host_of), in this communicator's order: the colour
  // of its split_across_hosts.
  int place_on_host(int rank) const;
};

}  // namespace zest
