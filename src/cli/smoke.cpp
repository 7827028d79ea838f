// zest smoke: brings the runtime up on every rank and checks it end to end — the device budget and
// its accounting, asynchronous streams, every collective in every dtype against values computed
// independently — then reports memory per rank and the all-reduce bandwidth. It is the main job
// until the memory benchmark exists, and a quick health check of an installation.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "args/args.hpp"
#include "cli/commands.hpp"
#include "runtime/host/half.hpp"
#include "zest/zest.hpp"

namespace zest::cli {
namespace {

// Values whose sums over up to 64 ranks are exact in fp16 and bf16, so every backend must agree
// bit for bit with the host's own computation.
float value_at(int rank, std::size_t i) { return static_cast<float>((i % 13) + 2 * rank); }

class SmokeRun {
 public:
  explicit SmokeRun(Runtime& runtime)
      : runtime_(runtime),
        device_(runtime.device()),
        comm_(runtime.comm()),
        stream_(device_.create_stream()),
        staging_(device_.allocate_pinned(kElements * sizeof(float) * 4)) {}

  // Runs each collective in each dtype; returns the number of checks that failed on this rank.
  int check_collectives() {
    int failures = 0;
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      failures += check_all_reduce(dtype);
      failures += check_reduce_scatter(dtype);
      failures += check_all_gather(dtype);
      failures += check_broadcast(dtype);
    }
    return failures;
  }

  // Bus bandwidth of an fp32 all-reduce, as nccl-tests defines it: 2(n-1)/n * bytes / time.
  double all_reduce_bus_gbps(std::size_t bytes, int iterations) {
    DeviceBuffer buffer = device_.allocate(bytes, MemoryCategory::grads);
    device_.memset_async(buffer.data(), 0, bytes, *stream_);
    comm_.all_reduce(buffer.data(), buffer.data(), bytes / 4, DType::f32, ReduceOp::sum, *stream_);
    stream_->synchronize();
    comm_.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i)
      comm_.all_reduce(buffer.data(), buffer.data(), bytes / 4, DType::f32, ReduceOp::sum, *stream_);
    stream_->synchronize();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
    const int n = comm_.size();
    return n == 1 ? 0.0 : 2.0 * (n - 1) / n * static_cast<double>(bytes) / seconds / 1e9;
  }

  Stream& stream() { return *stream_; }

 private:
  static constexpr std::size_t kElements = 1000003;  // odd on purpose: no rank count divides it

  // Fills a device buffer from host values through the pinned staging buffer.
  void upload(const DeviceBuffer& dst, DType dtype, std::size_t count, auto value_of) {
    for (std::size_t i = 0; i < count; ++i) store_from_float(staging_.data(), dtype, i, value_of(i));
    device_.copy_async(dst.data(), staging_.data(), count * dtype_size(dtype), *stream_);
  }

  // Copies back and counts mismatches; prints the first one.
  int verify(const char* what, const DeviceBuffer& src, DType dtype, std::size_t count,
             auto expected_of) {
    device_.copy_async(staging_.data(), src.data(), count * dtype_size(dtype), *stream_);
    stream_->synchronize();
    for (std::size_t i = 0; i < count; ++i) {
      const float got = load_as_float(staging_.data(), dtype, i);
      const float want = expected_of(i);
      if (got != want) {
        std::fprintf(stderr, "rank %d: %s %s: element %zu is %g, expected %g\n", comm_.rank(), what,
                     std::string(dtype_name(dtype)).c_str(), i, got, want);
        return 1;
      }
    }
    return 0;
  }

  int check_all_reduce(DType dtype) {
    const int n = comm_.size(), r = comm_.rank();
    DeviceBuffer buffer = device_.allocate(kElements * dtype_size(dtype), MemoryCategory::grads);
    upload(buffer, dtype, kElements, [&](std::size_t i) { return value_at(r, i); });
    comm_.all_reduce(buffer.data(), buffer.data(), kElements, dtype, ReduceOp::sum, *stream_);
    int failures = verify("all_reduce(sum)", buffer, dtype, kElements, [&](std::size_t i) {
      float sum = 0;
      for (int k = 0; k < n; ++k) sum += value_at(k, i);
      return sum;
    });
    upload(buffer, dtype, kElements, [&](std::size_t i) { return value_at(r, i); });
    comm_.all_reduce(buffer.data(), buffer.data(), kElements, dtype, ReduceOp::max, *stream_);
    failures += verify("all_reduce(max)", buffer, dtype, kElements,
                       [&](std::size_t i) { return value_at(n - 1, i); });
    return failures;
  }

  int check_reduce_scatter(DType dtype) {
    const int n = comm_.size(), r = comm_.rank();
    const std::size_t shard = kElements / static_cast<std::size_t>(n) + 1;  // caller pads
    DeviceBuffer send = device_.allocate(shard * n * dtype_size(dtype), MemoryCategory::grads);
    DeviceBuffer recv = device_.allocate(shard * dtype_size(dtype), MemoryCategory::grads);
    upload(send, dtype, shard * n, [&](std::size_t i) { return value_at(r, i); });
    comm_.reduce_scatter(send.data(), recv.data(), shard, dtype, ReduceOp::sum, *stream_);
    return verify("reduce_scatter", recv, dtype, shard, [&](std::size_t i) {
      float sum = 0;
      for (int k = 0; k < n; ++k) sum += value_at(k, r * shard + i);
      return sum;
    });
  }

  int check_all_gather(DType dtype) {
    const int n = comm_.size(), r = comm_.rank();
    const std::size_t shard = kElements / static_cast<std::size_t>(n) + 1;
    DeviceBuffer send = device_.allocate(shard * dtype_size(dtype), MemoryCategory::params);
    DeviceBuffer recv = device_.allocate(shard * n * dtype_size(dtype), MemoryCategory::params);
    upload(send, dtype, shard, [&](std::size_t i) { return value_at(r, i); });
    comm_.all_gather(send.data(), recv.data(), shard, dtype, *stream_);
    return verify("all_gather", recv, dtype, shard * n,
                  [&](std::size_t i) { return value_at(static_cast<int>(i / shard), i % shard); });
  }

  int check_broadcast(DType dtype) {
    const int root = comm_.size() - 1, r = comm_.rank();
    DeviceBuffer buffer = device_.allocate(kElements * dtype_size(dtype), MemoryCategory::buffers);
    upload(buffer, dtype, kElements, [&](std::size_t i) { return value_at(r, i); });
    comm_.broadcast(buffer.data(), kElements, dtype, root, *stream_);
    return verify("broadcast", buffer, dtype, kElements,
                  [&](std::size_t i) { return value_at(root, i); });
  }

  Runtime& runtime_;
  Device& device_;
  Communicator& comm_;
  std::unique_ptr<Stream> stream_;
  HostBuffer staging_;
};

// Gathers one row of numbers per rank onto every rank (host values through a device buffer, so it
// works on either backend).
std::vector<double> gather_rows(Runtime& runtime, Stream& stream, const std::vector<double>& row) {
  Device& device = runtime.device();
  const std::size_t n = static_cast<std::size_t>(runtime.world_size());
  const std::size_t floats = row.size();
  HostBuffer host = device.allocate_pinned(floats * n * sizeof(float));
  DeviceBuffer gathered = device.allocate(floats * n * sizeof(float), MemoryCategory::buffers);
  float* mine = host.as<float>() + floats * static_cast<std::size_t>(runtime.rank());
  for (std::size_t i = 0; i < floats; ++i) mine[i] = static_cast<float>(row[i]);
  char* slot = static_cast<char*>(gathered.data()) + floats * sizeof(float) * runtime.rank();
  device.copy_async(slot, mine, floats * sizeof(float), stream);
  runtime.comm().all_gather(slot, gathered.data(), floats, DType::f32, stream);
  device.copy_async(host.data(), gathered.data(), floats * n * sizeof(float), stream);
  stream.synchronize();
  return std::vector<double>(host.as<float>(), host.as<float>() + floats * n);
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int smoke(int argc, char** argv) {
  constexpr const char* kSmokeUsage =
      "usage: zest smoke [--config FILE]\n"
      "  Runs the runtime on every rank (under mpirun, or alone): device memory, streams, collectives.\n";
  if (args::asks_for_help(argc, argv)) return args::print_usage(kSmokeUsage);
  std::string config_path;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
      config_path = argv[++i];
      if (config_path.empty()) {
        std::fprintf(stderr, "zest smoke: --config: the path is empty; give a config FILE, or leave --config out\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "zest smoke: unexpected argument '%s'\n%s", argv[i], kSmokeUsage);
      return 2;
    }
  }
  try {
    // A program's config (zest-train's model:, train:) runs the smoke test as that program would.
    const Config config = config_path.empty() ? Config{} : load_config(config_path, shipped_program_sections());
    Runtime runtime(config);
    const bool leader = runtime.rank() == 0;
    if (leader)
      std::printf("zest smoke: %d rank(s), device %s, communicator %s\n  topology: %s\n",
                  runtime.world_size(), runtime.device().name().c_str(),
                  runtime.comm().backend_name().c_str(), runtime.topology().describe().c_str());

    // Optimizer states for a 1M-parameter shard (fp32 master, m, v), held through the run so every
    // category shows in the table.
    const DeviceBuffer optimizer_states =
        runtime.device().allocate(std::size_t{3} << 22, MemoryCategory::optimizer_states);
    SmokeRun run(runtime);
    const int failures = run.check_collectives();
    const double bus_gbps = run.all_reduce_bus_gbps(std::size_t{16} << 20, 10);

    // Past the budget, allocation must fail cleanly and leave the accounting untouched.
    int budget_failures = 0;
    const std::size_t before = runtime.device().memory_stats().current_total;
    try {
      runtime.device().allocate(runtime.device().memory_stats().budget + 1,
                                MemoryCategory::optimizer_states);
      budget_failures = 1;
    } catch (const OutOfDeviceMemory&) {
    }
    if (runtime.device().memory_stats().current_total != before) budget_failures = 1;

    const MemoryStats stats = runtime.device().memory_stats();
    std::vector<double> row = {static_cast<double>(failures + budget_failures),
                               mib(stats.peak_of(MemoryCategory::params)),
                               mib(stats.peak_of(MemoryCategory::grads)),
                               mib(stats.peak_of(MemoryCategory::optimizer_states)),
                               mib(stats.peak_of(MemoryCategory::buffers)),
                               mib(stats.peak_total),
                               mib(stats.budget),
                               mib(runtime.device().pinned_stats().peak),
                               static_cast<double>(runtime.cpus().size())};
    const std::vector<double> all = gather_rows(runtime, run.stream(), row);
    int total_failures = 0;
    if (leader) {
      std::printf("\n  rank  params  grads  optim  buffers  peak MiB  budget MiB  pinned MiB  cpus  checks\n");
      for (int r = 0; r < runtime.world_size(); ++r) {
        const double* v = &all[row.size() * static_cast<std::size_t>(r)];
        std::printf("  %4d  %6.1f  %5.1f  %5.1f  %7.1f  %8.1f  %10.1f  %10.1f  %4.0f  %s\n", r, v[1],
                    v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[0] == 0 ? "ok" : "FAILED");
      }
      if (runtime.world_size() > 1)
        std::printf("\n  all_reduce fp32 16MiB: %.2f GB/s bus bandwidth\n", bus_gbps);
    }
    for (int r = 0; r < runtime.world_size(); ++r)
      total_failures += static_cast<int>(all[row.size() * static_cast<std::size_t>(r)]);
    if (leader)
      std::printf("\nzest smoke: %s\n", total_failures == 0 ? "every check passed" : "FAILED");
    return total_failures == 0 ? 0 : 1;
  } catch (const ConfigError& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  } catch (const Error& error) {
    std::fprintf(stderr, "zest smoke: %s\n", error.what());
    return 1;
  }
}

}  // namespace zest::cli
