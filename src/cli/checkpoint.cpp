// zest checkpoint inspect|consolidate: a checkpoint written by Engine::save, read without an engine
// or ranks (zest/checkpoint.hpp).
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "args/args.hpp"
#include "cli/commands.hpp"
#include "zest/checkpoint.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest::cli {
namespace {

constexpr const char* kCheckpointUsage =
    "usage: zest checkpoint inspect DIR [--no-verify]\n"
    "       zest checkpoint consolidate DIR OUT [--dtype f32|bf16|f16]\n"
    "\n"
    "inspect prints the checkpoint's manifest (format, ranks, stage, steps, loss scale, config, its\n"
    "tensors and files), then checks every file's size and every chunk's CRC32C: exit 0 when all\n"
    "are intact, 1 when any is damaged (each problem is printed), 2 when DIR is not a readable\n"
    "checkpoint. --no-verify skips the checksums.\n"
    "\n"
    "consolidate writes the checkpoint's weights (its fp32 master weights) as one safetensors file\n"
    "OUT, in f32 (default) or rounded to nearest even to bf16 or f16. It streams: memory stays a\n"
    "few MiB whatever the model's size. Every chunk read is verified; on any error OUT is left as\n"
    "it was. Load it in PyTorch with safetensors.torch.load_file(OUT).\n";

int usage_error(const std::string& what) {
  std::fprintf(stderr, "zest checkpoint: %s\n\n%s", what.c_str(), kCheckpointUsage);
  return 2;
}

std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text.append(i ? ", " : "").append(std::to_string(shape[i]));
  return text.append("]");
}

std::size_t numel(const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

// Rows of cells, left-aligned columns two spaces apart, indented by two.
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line = " ";
    for (std::size_t c = 0; c < row.size(); ++c)
      line.append(" ").append(row[c]).append(c + 1 < row.size() ? widths[c] - row[c].size() + 1 : 0, ' ');
    std::printf("%s\n", line.c_str());
  }
}

void print_summary(const std::string& dir, const CheckpointInfo& info) {
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  format version %d, saved by %d rank%s at stage %d\n", info.format_version, info.world_size,
              info.world_size == 1 ? "" : "s", info.stage);
  std::printf("  steps %lld (%lld skipped), loss scale %g\n", static_cast<long long>(info.steps),
              static_cast<long long>(info.skipped_steps), info.loss_scale);
  std::printf("  config: %s\n", info.config.c_str());
  std::printf("  optimizer states: master fp32, m and v %s\n", std::string(states_format_name(info.states)).c_str());
  std::printf("  checksum chunk: %s\n", format_size(static_cast<std::size_t>(info.chunk_bytes)).c_str());

  std::vector<std::vector<std::string>> rows = {{"name", "shape", "group", "numel"}};
  std::size_t values = 0;
  for (const CheckpointTensorInfo& t : info.tensors) {
    rows.push_back({t.name, shape_text(t.shape), std::to_string(t.group), std::to_string(numel(t.shape))});
    values += numel(t.shape);
  }
  std::printf("tensors: %zu, %zu values (%zu bytes of fp32 weights)\n", info.tensors.size(), values,
              values * sizeof(float));
  print_table(rows);

  rows = {{"file", "bytes", "chunks"}};
  std::uint64_t bytes = 0;
  std::size_t chunks = 0;
  for (const CheckpointFileInfo& f : info.files) {
    rows.push_back({f.name, std::to_string(f.bytes), std::to_string(f.chunks)});
    bytes += f.bytes;
    chunks += f.chunks;
  }
  std::printf("files: %zu, %llu bytes in %zu chunks\n", info.files.size(), static_cast<unsigned long long>(bytes),
              chunks);
  print_table(rows);
}

// Returns the exit code: 0 intact, 1 damaged.
int print_verification(const std::string& dir, const CheckpointInfo& info) {
  std::size_t chunks = 0;
  for (const CheckpointFileInfo& f : info.files) chunks += f.chunks;
  const std::vector<std::string> problems = verify_checkpoint(dir);
  if (problems.empty()) {
    std::printf("checksums: %zu chunks in %zu files verified, all intact\n", chunks, info.files.size());
    return 0;
  }
  for (const std::string& problem : problems) std::printf("damaged: %s\n", problem.c_str());
  std::printf("checksums: %zu problem%s in %zu files: the checkpoint is damaged; load an earlier checkpoint "
              "or save this one again\n", problems.size(), problems.size() == 1 ? "" : "s", info.files.size());
  return 1;
}

int inspect(int argc, char** argv) {
  std::string dir;
  bool verify = true;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-verify") == 0) verify = false;
    else if (argv[i][0] == '-')
      return usage_error(std::string("inspect: unknown option '").append(argv[i]).append("'"));
    else if (dir.empty()) dir = argv[i];
    else return usage_error("inspect: expected one DIR");
  }
  if (dir.empty()) return usage_error("inspect: missing the checkpoint DIR");
  CheckpointInfo info;
  try {
    info = read_checkpoint_info(dir);
  } catch (const Error& e) {
    std::fprintf(
        stderr, "zest checkpoint inspect: %s\n(DIR must be a directory written by Engine::save or zest-train --save)\n",
        e.what());
    return 2;
  }
  print_summary(dir, info);
  if (!verify) {
    std::printf("checksums: not verified (--no-verify)\n");
    return 0;
  }
  try {
    return print_verification(dir, info);
  } catch (const Error& e) {  // the manifest changed or vanished since it was read
    std::fprintf(stderr, "zest checkpoint inspect: %s\n", e.what());
    return 2;
  }
}

bool parse_dtype(const std::string& text, DType& dtype) {
  if (text == "f32" || text == "fp32") dtype = DType::f32;
  else if (text == "bf16") dtype = DType::bf16;
  else if (text == "f16" || text == "fp16") dtype = DType::f16;
  else return false;
  return true;
}

int consolidate(int argc, char** argv) {
  std::vector<std::string> paths;
  DType dtype = DType::f32;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--dtype") == 0) {
      if (i + 1 >= argc || !parse_dtype(argv[i + 1], dtype))
        return usage_error(std::string("consolidate: --dtype expects f32, bf16 or f16, found '")
                               .append(i + 1 < argc ? argv[i + 1] : "").append("'"));
      ++i;
    } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
      return usage_error(std::string("consolidate: unknown option '").append(argv[i]).append("'"));
    } else {
      paths.push_back(argv[i]);
    }
  }
  if (paths.size() != 2) return usage_error("consolidate: expected the checkpoint DIR and the OUT file");
  // consolidate_checkpoint checks OUT before it reads anything (zest/checkpoint.hpp).
  try {
    const std::size_t tensors = read_checkpoint_info(paths[0]).tensors.size();
    consolidate_checkpoint(paths[0], paths[1], dtype);
    struct stat written {};
    ::stat(paths[1].c_str(), &written);
    std::printf("wrote %zu tensors (%s, %lld bytes) to %s\n", tensors, std::string(dtype_name(dtype)).c_str(),
                static_cast<long long>(written.st_size), paths[1].c_str());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "zest checkpoint consolidate: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int checkpoint(int argc, char** argv) {
  const std::string sub = argc >= 1 ? argv[0] : "";
  if (args::asks_for_help(argc, argv)) return args::print_usage(kCheckpointUsage);
  if (sub == "inspect") return inspect(argc - 1, argv + 1);
  if (sub == "consolidate") return consolidate(argc - 1, argv + 1);
  return usage_error(sub.empty() ? "missing inspect or consolidate"
                                 : std::string("unknown subcommand '").append(sub).append("'"));
}

}  // namespace zest::cli
