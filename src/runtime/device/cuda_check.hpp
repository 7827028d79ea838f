// Checks a CUDA runtime call; throws SystemError with the call's text, CUDA's error name and
// description, and the source location. Out-of-memory is reported by the Device as
// OutOfDeviceMemory instead, where it knows the budget.
#pragma once

#include <cuda_runtime.h>

#include <source_location>
#include <string>

#include "zest/error.hpp"

namespace zest::detail {

[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t code,
                                          std::source_location where) {
  throw SystemError(std::string(call) + " failed: " + cudaGetErrorName(code) + " (" +
                    cudaGetErrorString(code) + ") at " + where.file_name() + ":" +
                    std::to_string(where.line()));
}

}  // namespace zest::detail

#define ZEST_CUDA_CHECK(call)                                                              \
  do {                                                                                     \
    const cudaError_t zest_cuda_code_ = (call);                                            \
    if (zest_cuda_code_ != cudaSuccess)                                                    \
      ::zest::detail::throw_cuda_error(#call, zest_cuda_code_, std::source_location::current()); \
  } while (0)
