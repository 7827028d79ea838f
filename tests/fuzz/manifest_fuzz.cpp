// libFuzzer target: the checkpoint manifest parser (checkpoint::parse, what every reader of a
// checkpoint runs first). The input's closing checksum line is recomputed, so mutations reach the
// checks behind it (a hand-edited manifest with its checksum recomputed is a case users hit).
// Any input either throws zest::Error or parses into a manifest whose sizes are consistent and whose
// every field is in the range a saving engine produces (the checks behind the checksum), which
// serializes and parses back to the same, and whose safetensors header is written or refused
// with zest::Error. No allocation may be sized by an unchecked count (-rss_limit_mb catches it).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/safetensors_header.hpp"
#include "offload/checksum.hpp"
#include "zest/error.hpp"

namespace ckpt = zest::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  if (const std::size_t end = text.rfind("end "); end != std::string::npos) text.erase(end);
  const std::uint32_t crc = zest::offload::crc32c(text.data(), text.size());
  text.append("end ").append(std::to_string(crc)).append("\n");
  ckpt::Manifest m;
  try {
    m = ckpt::parse(text, "<fuzz>");
  } catch (const zest::Error&) {
    return 0;
  }
  for (const ckpt::RankEntry& rank : m.ranks)
    for (const ckpt::StateFile& file : rank.files)
      if (file.bytes != rank.elements() * sizeof(float) ||
          file.chunk_crcs.size() != file.bytes / m.chunk_bytes + (file.bytes % m.chunk_bytes != 0))
        std::abort();
  // What it means is in range: the fields a load acts on, each rank's files its own and of their
  // kind, every tensor element held by exactly one range, every name one the Engine accepts.
  if (m.stage < 0 || m.stage > 3 || m.steps < 0 || m.steps > ckpt::kMaxSteps || m.skipped < 0 || m.skipped > m.steps ||
      !std::isfinite(m.loss_scale) || m.loss_scale <= 0 || m.clean_steps < 0 || m.hysteresis_left < 0)
    std::abort();
  for (std::size_t r = 0; r < m.ranks.size(); ++r)
    for (int state = 0; state < ckpt::kStates; ++state)
      if (m.ranks[r].files[static_cast<std::size_t>(state)].name !=
          ckpt::state_file_name(static_cast<int>(r), static_cast<ckpt::StateKind>(state)))
        std::abort();
  std::vector<std::uint64_t> held(m.tensors.size(), 0);
  for (const ckpt::RankEntry& rank : m.ranks)
    for (const ckpt::Range& range : rank.ranges) held[range.tensor] += range.hi - range.lo;
  for (std::size_t t = 0; t < m.tensors.size(); ++t)
    if (held[t] != m.tensors[t].numel || m.tensors[t].group < 0 ||
        !ckpt::tensor_name_problem(m.tensors[t].name).empty())
      std::abort();
  try {
    const ckpt::Manifest again = ckpt::parse(ckpt::serialize(m), "<fuzz round trip>");
    if (ckpt::serialize(again) != ckpt::serialize(m)) std::abort();
  } catch (const zest::Error&) {
    // What parse accepted, serialize must write in a form parse accepts, except for a tensor name
    // or config text that holds a line break (serialize writes them on one line).
    bool multi_line = m.config.find_first_of("\r\n") != std::string::npos;
    for (const ckpt::TensorEntry& t : m.tensors) multi_line |= t.name.find_first_of("\r\n") != std::string::npos;
    if (!multi_line) std::abort();
  }
  try {
    const std::string header = ckpt::safetensors_header(m, zest::DType::bf16, "<fuzz>");
    if (header.size() % 8 != 0) std::abort();
  } catch (const zest::Error&) {
  }
  return 0;
}
