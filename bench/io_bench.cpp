// zest bench io: sequential write and read bandwidth of the NVMe store (io_uring, O_DIRECT, the
// configured block size and queue depth) against a plain synchronous O_DIRECT pwrite/pread loop
// with the same block size on the same file system, interleaved in one run (median of --reps).
// The store streams 64 MiB regions through 4 pinned, registered buffers, as the offloaded step
// does; the loop moves the same bytes one block at a time from one buffer.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "args/args.hpp"
#include "bench_commands.hpp"
#include "offload/nvme_store.hpp"
#include "store_bandwidth.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"
#include "zest/topology.hpp"

namespace zest::cli {
namespace {

using bench::store_pass;

constexpr const char* kIoUsage =
    "usage: zest bench io --path DIR [--path DIR2 ...] [--size GiB] [--reps N] [--config FILE]\n"
    "                     [--block-size SIZE] [--queue-depth N] [--threads N] [--no-fixed-buffers] [--json]\n"
    "  Writes then reads --size GiB (default 4) sequentially in DIR with the NVMe store and with a\n"
    "  synchronous O_DIRECT pwrite/pread loop; needs twice --size free in DIR. The io settings\n"
    "  come from the config's io: section (defaults: 1MiB blocks, queue depth 8 per ring, 1 ring),\n"
    "  then the flags. Several --path: the store stripes across them (the sync loop uses the first).\n";

constexpr std::size_t kRegionBytes = std::size_t{64} << 20;
constexpr std::size_t kBuffers = 4;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The synchronous baseline: one file, one block per call.
class SyncLoop {
 public:
  SyncLoop(const std::string& directory, std::size_t bytes, std::size_t block)
      : path_(directory + "/zest-bench-io-sync.tmp"), bytes_(bytes), block_(block) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600);
    if (fd_ < 0 && errno == EINVAL) fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd_ < 0) throw IoError("zest bench io: cannot create the baseline file", path_, 0, 0, errno);
    if (::fallocate(fd_, 0, 0, static_cast<off_t>(bytes)) != 0)
      throw IoError("zest bench io: cannot reserve the baseline file (is there twice --size free?)", path_, 0, bytes,
                    errno);
  }
  ~SyncLoop() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  SyncLoop(const SyncLoop&) = delete;
  SyncLoop& operator=(const SyncLoop&) = delete;

  // Moves bytes_ through `buffer` (buffer_bytes long, a multiple of the block); seconds taken.
  double pass(bool write, char* buffer, std::size_t buffer_bytes) {
    const auto start = Clock::now();
    for (std::size_t offset = 0; offset < bytes_; offset += block_) {
      char* data = buffer + offset % buffer_bytes;
      const std::size_t length = std::min(block_, bytes_ - offset);
      std::size_t done = 0;
      while (done < length) {
        const ssize_t n = write ? ::pwrite(fd_, data + done, length - done, static_cast<off_t>(offset + done))
                                : ::pread(fd_, data + done, length - done, static_cast<off_t>(offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw IoError(write ? "zest bench io: pwrite failed" : "zest bench io: pread failed", path_,
                                  offset + done, length - done, n < 0 ? errno : EIO);
        done += static_cast<std::size_t>(n);
      }
    }
    return seconds_since(start);
  }

 private:
  std::string path_;
  std::size_t bytes_;
  std::size_t block_;
  int fd_ = -1;
};

struct Figures {
  std::vector<double> ours_write, ours_read, sync_write, sync_read;  // bytes per second
};

}  // namespace

int bench_io(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kIoUsage);
  std::vector<std::string> paths;
  std::string config_path;
  double size_gib = 4.0;
  long long reps = 3;
  bool json = false;
  bool register_buffers = true;
  std::size_t block_size = 0;  // 0: the config's
  long long queue_depth = 0;   // 0: the config's
  long long threads = 0;       // 0: the config's
  try {
    for (int i = 0; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--json") json = true;
      else if (arg == "--no-fixed-buffers") register_buffers = false;  // what registering the buffers is worth
      else if (arg == "--path") paths.emplace_back(args::path_of(argc, argv, i));
      else if (arg == "--config") config_path = args::path_of(argc, argv, i);
      // From 1MiB (about one region) to 16TiB, past any disk this measures.
      else if (arg == "--size") size_gib = args::parse_number(arg, args::value_of(argc, argv, i), 0.001, 16384);
      else if (arg == "--reps") reps = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1000);
      // io.block_size's and io.queue_depth's ranges (configs/reference.yaml).
      else if (arg == "--block-size")
        block_size = args::parse_size(arg, args::value_of(argc, argv, i), std::size_t{4} << 10, std::size_t{1} << 30);
      else if (arg == "--queue-depth") queue_depth = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 4096);
      else if (arg == "--threads") threads = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 64);
      else throw args::UsageError(std::string("unexpected argument '").append(arg).append("'"));
    }
    if (paths.empty()) throw args::UsageError("--path DIR is required");
    for (const std::string& path : paths) args::check_output_directory("--path", path);
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest bench io: %s\n%s", error.what(), kIoUsage);
    return 2;
  }

  try {
    IoConfig io;
    if (!config_path.empty()) io = load_config(config_path).io;
    if (block_size > 0) io.block_size = block_size;
    if (queue_depth > 0) io.queue_depth = static_cast<int>(queue_depth);
    if (threads > 0) io.threads = static_cast<int>(threads);
    io.checksum = false;  // bandwidth of the I/O path; the checksum costs CPU, measured elsewhere

    const auto requested = static_cast<std::size_t>(size_gib * static_cast<double>(std::size_t{1} << 30));
    const std::size_t region_bytes = std::min(kRegionBytes, std::max<std::size_t>(requested / 4096 * 4096, 4096));
    const std::size_t region_count = std::max<std::size_t>(requested / region_bytes, 1);
    const std::size_t total = region_count * region_bytes;

    offload::NvmeStoreOptions options;
    options.directories = paths;
    options.io = io;
    const Topology topology = Topology::detect();
    options.cpus = topology.cpus_for_rank(DeviceType::cpu, 0, 0, 1);
    offload::NvmeStore store(options);
    std::vector<offload::RegionId> regions;
    for (std::size_t i = 0; i < region_count; ++i)
      regions.push_back(store.allocate(std::string("bench").append(std::to_string(i)), region_bytes));

    auto device = make_cpu_device(std::size_t{1} << 20);
    std::vector<HostBuffer> buffers;
    std::vector<std::pair<void*, std::size_t>> registered;
    for (std::size_t k = 0; k < kBuffers; ++k) {
      buffers.push_back(device->allocate_pinned(region_bytes));
      std::memset(buffers.back().data(), static_cast<int>(0x5A + k), region_bytes);
      registered.emplace_back(buffers.back().data(), region_bytes);
    }
    bool fixed = register_buffers;
    try {
      if (register_buffers) store.register_buffers(registered);
    } catch (const SystemError& e) {
      fixed = false;  // still a valid run, with per-request page pinning; said in the output
      std::fprintf(stderr, "zest bench io: buffers not registered (%s)\n", e.what());
    }
    SyncLoop sync(paths.front(), total, io.block_size);

    Figures f;
    const auto rate = [&](double seconds) { return static_cast<double>(total) / seconds; };
    for (long long rep = 0; rep < reps; ++rep) {
      f.ours_write.push_back(rate(store_pass(store, true, regions, buffers)));
      store.flush();  // durable before reading back; not timed (fio's default does not sync either)
      f.sync_write.push_back(rate(sync.pass(true, static_cast<char*>(buffers[0].data()), region_bytes)));
      f.ours_read.push_back(rate(store_pass(store, false, regions, buffers)));
      f.sync_read.push_back(rate(sync.pass(false, static_cast<char*>(buffers[1].data()), region_bytes)));
    }
    const double w = median(f.ours_write), r = median(f.ours_read);
    const double sw = median(f.sync_write), sr = median(f.sync_read);
    if (json) {
      const nlohmann::ordered_json out = {{"path", store.path()},
                                          {"direct", store.direct()},
                                          {"fixed_buffers", fixed},
                                          {"size_bytes", total},
                                          {"block_size", io.block_size},
                                          {"queue_depth", io.queue_depth},
                                          {"threads", io.threads},
                                          {"directories", paths.size()},
                                          {"reps", reps},
                                          {"write_bytes_per_s", w},
                                          {"read_bytes_per_s", r},
                                          {"sync_write_bytes_per_s", sw},
                                          {"sync_read_bytes_per_s", sr},
                                          {"write_ratio_vs_sync", w / sw},
                                          {"read_ratio_vs_sync", r / sr},
                                          {"write_samples", f.ours_write},
                                          {"read_samples", f.ours_read},
                                          {"sync_write_samples", f.sync_write},
                                          {"sync_read_samples", f.sync_read}};
      // A path that is not UTF-8 is replaced in the output, not a reason to lose the figures.
      std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    } else {
      std::printf("zest bench io: %s, %.2f GiB, %s blocks, queue depth %d x %d ring(s), %s%s, median of %lld\n",
                  store.location().c_str(), static_cast<double>(total) / static_cast<double>(std::size_t{1} << 30),
                  format_size(io.block_size).c_str(), io.queue_depth, io.threads,
                  store.direct() ? "O_DIRECT" : "buffered (O_DIRECT refused)", fixed ? ", registered buffers" : "",
                  reps);
      std::printf("  %-28s %12s %12s\n", "", "write GB/s", "read GB/s");
      std::printf("  %-28s %12.3f %12.3f\n", "NvmeStore (io_uring)", w / 1e9, r / 1e9);
      std::printf("  %-28s %12.3f %12.3f\n", "sync O_DIRECT pwrite/pread", sw / 1e9, sr / 1e9);
      std::printf("  %-28s %12.2f %12.2f\n", "ratio", w / sw, r / sr);
    }
    return 0;
  } catch (const ConfigError& error) {  // the input, not the run: exit 2 as for a bad flag
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zest bench io: %s\n", e.what());
    return 1;
  }
}

}  // namespace zest::cli
