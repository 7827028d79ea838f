// libFuzzer target: the size parser ("25MiB", "1.5GB", "4096") behind config sizes and the CLI's
// size flags. parse_size_into and parse_size must agree: one accepts exactly what the other
// does, with the same bytes, and refusals throw what zest/config.hpp promises (std::invalid_argument
// today, not a zest::Error: reported to src/config's owner); no overflow or float-to-integer
// conversion out of range may reach UndefinedBehaviorSanitizer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "config/size_parse.hpp"
#include "zest/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::size_t bytes = 0;
  std::string why;
  const bool accepted = zest::detail::parse_size_into(text, bytes, why);
  if (!accepted && why.empty()) std::abort();  // a refusal always says why
  try {
    const std::size_t thrown_bytes = zest::parse_size(text);
    if (!accepted || thrown_bytes != bytes) std::abort();
  } catch (const std::invalid_argument&) {
    if (accepted) std::abort();
  }
  return 0;
}
