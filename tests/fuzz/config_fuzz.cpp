// libFuzzer target: the YAML config parser (zest::parse_config, what load_config runs on a file's
// text). Any input either parses into a Config that prints back (to_yaml) as a config that parses
// to the same, or throws ConfigError; nothing else may escape, crash or trip a sanitizer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "zest/config.hpp"
#include "zest/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  zest::Config config;
  try {
    config = zest::parse_config(text, "<fuzz>", {"model", "train"});
  } catch (const zest::ConfigError&) {
    return 0;
  }
  // A resolved config prints as YAML that parses again (the round trip `zest config check` shows).
  try {
    zest::parse_config(zest::to_yaml(config), "<fuzz round trip>");
  } catch (const zest::ConfigError&) {
    std::abort();
  }
  return 0;
}
