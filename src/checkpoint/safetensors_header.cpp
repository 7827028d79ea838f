#include "checkpoint/safetensors_header.hpp"

#include <cstdint>
#include <set>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
  }
  return "?";
}

// Safetensors metadata is a map of strings to strings: where the weights came from.
nlohmann::ordered_json metadata(const Manifest& m, DType dtype) {
  return {{"format", "pt"},
          {"zest_checkpoint_format", std::to_string(m.version)},
          {"zest_steps", std::to_string(m.steps)},
          {"zest_skipped_steps", std::to_string(m.skipped)},
          {"zest_world_size", std::to_string(m.world_size)},
          {"zest_stage", std::to_string(m.stage)},
          {"zest_weights",
           std::string("fp32 master weights").append(dtype == DType::f32 ? "" : ", rounded to nearest even")},
          {"zest_config", m.config}};
}

[[noreturn]] void unwritable(const std::string& dir, const std::string& what) {
  throw Error(fmt::format("checkpoint {}: {}", dir, what));
}

}  // namespace

std::string safetensors_header(const Manifest& m, DType dtype, const std::string& dir) {
  if (!valid_utf8(m.config))
    unwritable(
        dir,
        "the saving run's settings are not UTF-8, which safetensors' JSON header requires: the manifest is damaged");
  // Written entry by entry (a model has up to ~1e5 tensors), each entry a JSON value of its own.
  std::string out = std::string("{\"__metadata__\":").append(metadata(m, dtype).dump());
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const TensorEntry& t : m.tensors) {
    if (!valid_utf8(t.name))
      throw Error(
          fmt::format("checkpoint {}: tensor {}'s name is not UTF-8, which safetensors' JSON header requires; rename "
                      "the parameter in the trainer",
                      dir, names.size()));
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      throw Error(fmt::format(
          "checkpoint {}: tensor name '{}' {}: a safetensors file cannot hold it; rename the parameter in the trainer",
          dir, t.name, t.name == "__metadata__" ? "is reserved by safetensors" : "appears twice"));
    // A reader takes the shape and the offsets as they are: a shape that does not multiply to the
    // element count, or offsets that wrapped, would make a file no reader can use.
    std::uint64_t product = 1, bytes = 0, end = 0;
    for (std::size_t d : t.shape)
      if (__builtin_mul_overflow(product, std::uint64_t{d}, &product))
        unwritable(
            dir, std::string("tensor '").append(t.name).append("' has a shape whose element count overflows 64 bits"));
    if (product != t.numel)
      unwritable(
          dir,
          std::string("tensor '").append(t.name).append("' has a shape that does not multiply to its element count"));
    if (__builtin_mul_overflow(std::uint64_t{t.numel}, std::uint64_t{dtype_size(dtype)}, &bytes) ||
        __builtin_add_overflow(offset, bytes, &end))
      unwritable(dir, "the tensors' bytes overflow safetensors' 64-bit offsets");
    const nlohmann::ordered_json entry = {
        {"dtype", safetensors_dtype(dtype)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    out.append(",").append(nlohmann::json(t.name).dump()).append(":").append(entry.dump());
    offset = end;
  }
  out.append("}");
  out.append((8 - out.size() % 8) % 8, ' ');
  return out;
}

}  // namespace zest::checkpoint
