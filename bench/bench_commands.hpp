// The benchmarks, run as `zest bench NAME` (src/cli/main.cpp dispatches to them). Each returns the
// process exit code: 0 success, 1 failure of the work itself, 2 invalid input (usage, config).
#pragma once

namespace zest::cli {

// zest bench adam [--threads N] [--params N] [--mode M] [--json] (bench/adam_bench.cpp)
int bench_adam(int argc, char** argv);
// zest bench io --path DIR [--size GiB] [--json]: NVMe store bandwidth (bench/io_bench.cpp)
int bench_io(int argc, char** argv);
// zest bench memory [options] (bench/memory_bench.cpp)
int bench_memory(int argc, char** argv);
// zest bench step --path DIR [options]: offloaded Adam step on NVMe vs the disk (bench/step_bench.cpp)
int bench_step(int argc, char** argv);

}  // namespace zest::cli
