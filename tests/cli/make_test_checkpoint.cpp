// Writes a synthetic checkpoint (tests/checkpoint/synthetic_checkpoint.hpp) for the CLI tests, or
// reseals a hand-edited manifest.
// usage: make_test_checkpoint DIR RANKS CHUNK_BYTES SHAPE:NAME...
//   SHAPE is dimensions joined by 'x' ("331x3", "4096"; empty for a scalar); NAME is the rest of
//   the argument, any characters. Tensor i is in group i.
// usage: make_test_checkpoint --reseal MANIFEST
//   Recomputes MANIFEST's closing checksum line after an edit (sed), as a user who edits a
//   manifest by hand would: only the checks behind the checksum stop what the edit means.
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/synthetic_checkpoint.hpp"
#include "offload/checksum.hpp"

namespace {

zest::ParamSpec parse_spec(const std::string& text, int group) {
  const std::size_t colon = text.find(':');
  if (colon == std::string::npos) throw std::invalid_argument("expected SHAPE:NAME, found '" + text + "'");
  zest::ParamSpec spec{text.substr(colon + 1), {}, group};
  for (std::size_t at = 0; at < colon;) {
    const std::size_t x = std::min(text.find('x', at), colon);
    spec.shape.push_back(std::stoull(text.substr(at, x - at)));
    at = x + 1;
  }
  return spec;
}

}  // namespace

// The manifest with its closing "end <crc32c>" line made anew over the text before it.
int reseal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (const std::size_t end = text.rfind("end "); end != std::string::npos) text.erase(end);
  const std::uint32_t crc = zest::offload::crc32c(text.data(), text.size());  // of the text before the line
  text.append("end ").append(std::to_string(crc)).append("\n");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--reseal") return reseal(argv[2]);
  if (argc < 5) {
    std::fprintf(stderr, "usage: make_test_checkpoint DIR RANKS CHUNK_BYTES SHAPE:NAME...\n");
    return 2;
  }
  try {
    std::vector<zest::ParamSpec> specs;
    for (int i = 4; i < argc; ++i) specs.push_back(parse_spec(argv[i], i - 4));
    zest::synthetic_checkpoint::write(argv[1], specs, std::atoi(argv[2]), std::stoull(argv[3]));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_test_checkpoint: %s\n", e.what());
    return 1;
  }
}
