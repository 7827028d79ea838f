#include "runtime/comm/local_communicator.hpp"

#include <cstdint>
#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {
namespace {

bool overlap(const void* a, const void* b, std::size_t bytes) {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b);
  return bytes != 0 && a0 < b0 + bytes && b0 < a0 + bytes;
}

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(Device& device) : device_(device) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend_name() const override { return "local"; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp /*op*/,
                  Stream& stream) override {
    copy("all_reduce", send, recv, count, dtype, stream);
  }
  // One rank's block is the whole buffer, so every in-place convention is send == recv.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp /*op*/, Stream& stream) override {
    copy("reduce_scatter", send, recv, recv_count, dtype, stream);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                  Stream& stream) override {
    copy("all_gather", send, recv, send_count, dtype, stream);
  }
  // The one block goes to this rank itself. No in-place form, as on the other backends: send and
  // recv may not overlap at all.
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override {
    if (send != nullptr && recv != nullptr && overlap(send, recv, count * dtype_size(dtype))) {
      throw CommError(
          "all_to_all: send and recv overlap (an all-to-all has no in-place form); pass separate buffers");
    }
    copy("all_to_all", send, recv, count, dtype, stream);
  }
  void broadcast(void* buffer, std::size_t count, DType /*dtype*/, int root,
                 Stream& /*stream*/) override {
    if (root != 0) {
      throw CommError(fmt::format("broadcast: root {} is not a rank of this world of one; pass root 0", root));
    }
    check_buffer("broadcast", buffer, count);
  }
  void barrier() override {}
  void all_reduce_host(std::span<double> values, ReduceOp /*op*/) override {
    check_buffer("all_reduce_host", values.data(), values.size());
  }
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp /*op*/) override {
    check_buffer("all_reduce_host", values.data(), values.size());
  }

 private:
  static void check_buffer(const char* what, const void* buffer, std::size_t count) {
    if (count != 0 && buffer == nullptr) {
      throw CommError(fmt::format("{}: a buffer is null while count is {} (pass a buffer, or count 0)", what, count));
    }
  }

  void copy(const char* what, const void* send, void* recv, std::size_t count, DType dtype,
            Stream& stream) {
    check_buffer(what, send, count);
    check_buffer(what, recv, count);
    const std::size_t bytes = count * dtype_size(dtype);
    if (send == recv || bytes == 0) return;
    if (overlap(send, recv, bytes)) {
      throw CommError(std::string(what) +
                      ": send and recv overlap without being the same buffer; pass send == recv "
                      "to work in place");
    }
    device_.copy_async(recv, send, bytes, stream);
  }

  Device& device_;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(Device& device) {
  return std::make_unique<LocalCommunicator>(device);
}

}  // namespace zest
