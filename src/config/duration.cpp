// Durations in the config ("300s", "5min", "1h", "0"): the parser, shared by the config reader
// (which reports the reason next to its key) and to_yaml (which writes what the parser reads).
#include "config/duration_parse.hpp"

#include <charconv>
#include <cmath>
#include <string>

#include <fmt/core.h>

namespace zest::detail {
namespace {

struct Unit {
  std::string_view name;
  double milliseconds;
};
// Longest names first, so "ms" and "min" are not read as "m..." of something shorter.
constexpr Unit kUnits[] = {{"min", 60e3}, {"ms", 1.0}, {"s", 1e3}, {"h", 3600e3}};

}  // namespace

const char* const kDurationUnitsHelp = "ms, s, min, h";

bool parse_duration_into(std::string_view text, std::chrono::milliseconds& out, std::string& why) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || !std::isfinite(value) || value < 0) {
    why = "it does not start with a number of at least 0";
    return false;
  }
  std::string_view unit(end, static_cast<std::size_t>(text.data() + text.size() - end));
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  if (unit.empty()) {
    // A bare number could mean seconds or milliseconds; only 0 reads the same in every unit.
    if (value == 0) {
      out = std::chrono::milliseconds(0);
      return true;
    }
    why = std::string("a unit is missing; units are ") + kDurationUnitsHelp;
    return false;
  }
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    const double ms = std::round(value * u.milliseconds);
    // A week is far past any collective; the cap keeps deadlines from overflowing a clock.
    if (ms > 7 * 24 * 3600e3) {
      why = "it is longer than a week (use 0 to turn the timeout off)";
      return false;
    }
    out = std::chrono::milliseconds(static_cast<long long>(ms));
    return true;
  }
  why = fmt::format("unknown unit '{}'; units are {}", unit, kDurationUnitsHelp);
  return false;
}

std::string format_duration(std::chrono::milliseconds duration) {
  const long long ms = duration.count();
  if (ms == 0) return "0";
  if (ms % 3600000 == 0) return std::to_string(ms / 3600000) + "h";
  if (ms % 60000 == 0) return std::to_string(ms / 60000) + "min";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

}  // namespace zest::detail
