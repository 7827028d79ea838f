// Small text helpers for error messages, shared by every layer above base.
#pragma once

#include <string>
#include <string_view>

namespace zest {

// `text` in single quotes, as messages name a key, a path or a value. (Not `quoted`: with a
// std::string argument, argument-dependent lookup would also find std::quoted, which GCC 13's
// headers make visible and prefer.)
inline std::string in_quotes(std::string_view text) {
  std::string out = "'";
  return out.append(text).append("'");
}

}  // namespace zest
