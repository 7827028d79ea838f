// A trainer's view of an installed zest: only the public headers and `pkg-config zest`.
#include <zest/zest.hpp>

#include <cstdio>

int main() {
  const zest::Config config = zest::parse_config("device:\n  type: cpu\n  memory: 64MiB\n");
  auto device = zest::make_cpu_device(config.device.memory);
  zest::DeviceBuffer buffer = device->allocate(1 << 20, zest::MemoryCategory::params);
  const bool counted = device->memory_stats().current_of(zest::MemoryCategory::params) >= (1u << 20);
  std::printf("%s\n", counted ? "consumer: ok" : "consumer: memory not counted");
  return counted ? 0 : 1;
}
