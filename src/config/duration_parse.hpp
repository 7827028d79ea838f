// Duration parsing for config keys such as comm.timeout: "500ms", "300s", "5min", "1h", "0".
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace zest::detail {

// The accepted units, for messages.
extern const char* const kDurationUnitsHelp;

// Parses `text` (a number >= 0 and a unit; 0 may stand alone). On failure returns false and sets
// `why` to the reason alone, e.g. "unknown unit 'sec'; units are ms, s, min, h".
bool parse_duration_into(std::string_view text, std::chrono::milliseconds& out, std::string& why);

// The largest whole unit: 300000ms -> "5min"; what parse_duration_into reads back.
std::string format_duration(std::chrono::milliseconds duration);

}  // namespace zest::detail
