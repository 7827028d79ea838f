// Checks an MPI call. MPI's default handler aborts the job; zest installs MPI_ERRORS_RETURN on its
// communicators so failures reach here and become CommError with the call's text and MPI's words.
#pragma once

#include <mpi.h>

#include <source_location>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::detail {

[[noreturn]] inline void throw_mpi_error(const char* call, int code, std::source_location where) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  throw CommError(fmt::format("{} failed: {} at {}:{}", call, std::string_view(text, static_cast<size_t>(length)),
                              where.file_name(), where.line()));
}

}  // namespace zest::detail

#define ZEST_MPI_CHECK(call)                                                              \
  do {                                                                                    \
    const int zest_mpi_code_ = (call);                                                    \
    if (zest_mpi_code_ != MPI_SUCCESS)                                                    \
      ::zest::detail::throw_mpi_error(#call, zest_mpi_code_, std::source_location::current()); \
  } while (0)
