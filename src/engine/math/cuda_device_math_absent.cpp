// Built in place of the CUDA math when zest is built without CUDA, so the engine links unchanged.
// (A cuda Device cannot exist in such a build either; this says why if one is ever asked for.)
#include <memory>

#include "engine/math/device_math.hpp"
#include "zest/error.hpp"

namespace zest::engine {

std::unique_ptr<DeviceMath> make_cuda_device_math(Device& /*device*/, const optim::AdamHyperParams& /*hyper*/,
                                                  std::size_t /*max_spans*/) {
  throw SystemError(
      "the engine's CUDA step is not available: zest was built without CUDA; rebuild with "
      "-Dcuda=enabled on a machine with the CUDA toolkit, or set device.type: cpu");
}

}  // namespace zest::engine
