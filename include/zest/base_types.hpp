// What the configuration and the runtime both speak of, in the layer under both (with
// zest/error.hpp and zest/dtype.hpp): the kind of device, and the communicator's default timeout
// (comm.timeout's default, and what a communicator made without a config waits).
#pragma once

#include <chrono>

namespace zest {

enum class DeviceType { cpu, cuda };

inline constexpr std::chrono::milliseconds kDefaultCommTimeout = std::chrono::minutes(10);

}  // namespace zest
