#include "engine/device_math.hpp"

namespace zest::engine {

std::unique_ptr<DeviceMath> make_device_math(Device& device, const optim::AdamHyperParams& hyper,
                                             int threads, std::size_t max_spans) {
  switch (device.type()) {
    case DeviceType::cpu: return make_cpu_device_math(hyper, threads, device.host_cpus());
    case DeviceType::cuda: return make_cuda_device_math(device, hyper, max_spans);
  }
  return make_cpu_device_math(hyper, threads, device.host_cpus());  // unreachable: every DeviceType is handled above
}

}  // namespace zest::engine
