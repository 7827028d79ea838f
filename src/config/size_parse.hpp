// Size parsing shared by parse_size (which throws) and the config parser (which collects the
// reason into a ConfigProblem next to the key it belongs to).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace zest::detail {

// The accepted units, for messages: "B, KiB, MiB, GiB, TiB (powers of 1024); kB/KB, MB, GB, TB
// (powers of 1000)".
extern const char* const kSizeUnitsHelp;

// Parses `text` into bytes. On failure returns false and sets `why` to the reason alone (no
// quoting of `text`), e.g. "unknown unit 'XB'; units are ...".
bool parse_size_into(std::string_view text, std::size_t& bytes, std::string& why);

}  // namespace zest::detail
