#include "engine/plan/shared_settings.hpp"

#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace zest::engine {
namespace {

// Keys a rank may set for itself: its memory budget, how long it waits, its threads, its local
// directories and buffers. Each changes what this rank holds or how fast it goes, never what it
// sends or the values it computes. Every other key is shared, new ones included.
constexpr std::array<std::string_view, 11> kPerRank{
    "device.memory",          "comm.timeout",             "optimizer.threads",
    "offload.optimizer.path", "offload.optimizer.pinned", "offload.optimizer.buffer_count",
    "offload.param.path",     "offload.param.pinned",     "offload.param.buffer_count",
    "offload.sub_group",      "io."};

bool per_rank(const std::string& key) {
  for (const std::string_view k : kPerRank)
    if (k.back() == '.' ? key.starts_with(k) : key == k) return true;
  return false;
}

// to_yaml's lines are "  key: value" or "  section:" (two spaces a level, one line a key).
void add_config(const Config& config, std::vector<SharedValue>& out) {
  std::istringstream lines(to_yaml(config));
  std::vector<std::string> sections;
  for (std::string line; std::getline(lines, line);) {
    const std::size_t indent = line.find_first_not_of(' ');
    const std::size_t colon = line.find(':', indent);
    if (indent == std::string::npos || colon == std::string::npos) continue;
    sections.resize(indent / 2);
    const std::string name = line.substr(indent, colon - indent);
    if (colon + 1 == line.size()) {
      sections.push_back(name);
      continue;
    }
    std::string key;
    for (const std::string& s : sections) key.append(s).push_back('.');
    key.append(name);
    if (!per_rank(key)) out.push_back({key, line.substr(colon + 2)});
  }
}

}  // namespace

std::vector<SharedValue> settings_ranks_share(const Config& config, std::span<const ParamSpec> params) {
  std::vector<SharedValue> shared;
  add_config(config, shared);
  // The model: compared whole, quoted by its size and a digest (a name or a shape that differs
  // anywhere changes it).
  std::uint64_t digest = 1469598103934665603ull;
  const auto mix = [&](std::string_view text) {
    for (const char c : text) digest = (digest ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    digest = (digest ^ 0xffu) * 1099511628211ull;
  };
  std::size_t numel = 0;
  for (const ParamSpec& p : params) {
    mix(p.name);
    for (const std::size_t d : p.shape) mix(std::to_string(d));
    mix(std::to_string(p.group));
    numel += p.numel();
  }
  std::ostringstream model;
  model << params.size() << " tensors, " << numel << " elements, digest " << std::hex << (digest >> 1);
  shared.push_back({"the model (its parameters' names, shapes and groups)", model.str()});
  return shared;
}

}  // namespace zest::engine
