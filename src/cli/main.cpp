// The `zest` command: one entry point, subcommands in their own files.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "bench_commands.hpp"
#include "cli/commands.hpp"

namespace {

constexpr const char* kUsage =
    "usage: zest <command> [args]\n"
    "\n"
    "commands:\n"
    "  config check FILE        validate a config; print it resolved, or every error (exit 2)\n"
    "  smoke [--config FILE]    run the runtime on every rank: memory, streams, collectives\n"
    "  estimate --params N      memory per device, host and NVMe of every stage and offload mode\n"
    "  checkpoint inspect DIR   a checkpoint's manifest, tensors and files; verify every checksum\n"
    "  checkpoint consolidate DIR OUT [--dtype f32|bf16|f16]\n"
    "                           its weights as one safetensors file, streamed\n"
    "  bench adam [options]     CPU/GPU Adam throughput against the machine's memory roofline\n"
    "  bench io --path DIR      NVMe store bandwidth against a synchronous O_DIRECT loop\n"
    "  bench memory [options]   memory per rank of ZeRO stages 0-3 against DDP on a real model\n"
    "  bench step --path DIR    offloaded Adam step with states on NVMe against the disk's limit\n";

constexpr const char* kConfigUsage =
    "usage: zest config check FILE [--program NAME | --sections LIST]   (zest config check --help: more)\n";

constexpr const char* kBenchUsage =
    "usage: zest bench <adam|io|memory|step> [options]   (zest bench NAME --help: its options)\n"
    "  adam     CPU/GPU Adam throughput against the machine's memory roofline (--peers: DeepSpeed, torch)\n"
    "  io       NVMe store bandwidth against a synchronous O_DIRECT loop\n"
    "  memory   memory per rank of ZeRO stages 0-3 against DDP on a real model (--peers: torch DDP, FSDP2)\n"
    "  step     offloaded Adam step with states on NVMe against the disk's limit\n";

// A command with subcommands reached without a known one: its usage, on stdout for --help (exit
// 0), else on stderr after saying what was wrong (exit 2).
int subcommand_usage(const char* command, const char* usage, int argc, char** argv) {
  if (argc >= 3 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0)) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (argc < 3) std::fprintf(stderr, "zest %s: missing its subcommand\n\n%s", command, usage);
  else std::fprintf(stderr, "zest %s: unknown subcommand '%s'\n\n%s", command, argv[2], usage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file-size limit (ulimit -f) then fails with EFBIG, which the writers report
  // and clean up after (a temporary file removed, the previous output kept), instead of SIGXFSZ
  // killing the process mid-write and leaving the temporary file behind.
  std::signal(SIGXFSZ, SIG_IGN);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (command == "config" && argc >= 3 && std::strcmp(argv[2], "check") == 0)
    return zest::cli::config_check(argc - 3, argv + 3);
  if (command == "smoke") return zest::cli::smoke(argc - 2, argv + 2);
  if (command == "estimate") return zest::cli::estimate(argc - 2, argv + 2);
  if (command == "checkpoint") return zest::cli::checkpoint(argc - 2, argv + 2);
  if (command == "bench" && argc >= 3 && std::strcmp(argv[2], "adam") == 0)
    return zest::cli::bench_adam(argc - 3, argv + 3);
  if (command == "bench" && argc >= 3 && std::strcmp(argv[2], "io") == 0)
    return zest::cli::bench_io(argc - 3, argv + 3);
  if (command == "bench" && argc >= 3 && std::strcmp(argv[2], "memory") == 0)
    return zest::cli::bench_memory(argc - 3, argv + 3);
  if (command == "bench" && argc >= 3 && std::strcmp(argv[2], "step") == 0)
    return zest::cli::bench_step(argc - 3, argv + 3);
  if (command == "config") return subcommand_usage("config", kConfigUsage, argc, argv);
  if (command == "bench") return subcommand_usage("bench", kBenchUsage, argc, argv);
  std::fprintf(stderr, "zest: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}
