// Checks an OS call that returns -1 and sets errno. Throws SystemError with the call's text, the
// errno description and the source location.
#pragma once

#include <cerrno>
#include <cstring>
#include <source_location>
#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::detail {

[[noreturn]] inline void throw_sys_error(const char* call, int error_number,
                                         std::source_location where) {
  throw SystemError(fmt::format("{} failed: {} (errno {}) at {}:{}", call, std::strerror(error_number), error_number,
                                where.file_name(), where.line()));
}

}  // namespace zest::detail

#define ZEST_SYS_CHECK(call)                                                                \
  do {                                                                                      \
    if ((call) == -1)                                                                       \
      ::zest::detail::throw_sys_error(#call, errno, std::source_location::current());      \
  } while (0)
