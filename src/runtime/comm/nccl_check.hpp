// Checks an NCCL call; throws CommError with the call's text, NCCL's description and its last
// error message, and the source location.
#pragma once

#include <nccl.h>

#include <source_location>
#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::detail {

[[noreturn]] inline void throw_nccl_error(const char* call, ncclResult_t code,
                                          std::source_location where) {
  throw CommError(fmt::format("{} failed: {} ({}) at {}:{}", call, ncclGetErrorString(code), ncclGetLastError(nullptr),
                              where.file_name(), where.line()));
}

}  // namespace zest::detail

#define ZEST_NCCL_CHECK(call)                                                              \
  do {                                                                                     \
    const ncclResult_t zest_nccl_code_ = (call);                                           \
    if (zest_nccl_code_ != ncclSuccess)                                                    \
      ::zest::detail::throw_nccl_error(#call, zest_nccl_code_, std::source_location::current()); \
  } while (0)
