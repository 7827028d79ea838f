// Run-time choice of the CPU Adam variant: the best the CPU runs, or the one ZEST_ADAM_ISA forces.
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "optim/adam_kernels.hpp"

namespace zest::optim {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

Isa select_isa() {
  const char* forced = std::getenv("ZEST_ADAM_ISA");
  if (forced == nullptr || *forced == '\0') {
    if (cpu_supports(Isa::avx512)) return Isa::avx512;
    if (cpu_supports(Isa::avx2)) return Isa::avx2;
    return Isa::scalar;
  }
  const std::string_view name(forced);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (name != isa_name(isa)) continue;
    if (!cpu_supports(isa))
      throw Error(std::string("ZEST_ADAM_ISA=").append(name).append(
          " asks for an instruction set this CPU does not support; unset it or choose scalar or "
          "avx2"));
    return isa;
  }
  throw Error(std::string("ZEST_ADAM_ISA=").append(name).append(
      " is not a CPU Adam variant; use scalar, avx2 or avx512 (or unset it)"));
}

const AdamKernels& adam_kernels(Isa isa) {
  static const AdamKernels scalar{Isa::scalar, &scalar_isa::adam, &scalar_isa::roofline,
                                  &scalar_isa::grad_stats, &scalar_isa::adam_compact,
                                  &scalar_isa::roofline_compact, &scalar_isa::widen_bf16, &scalar_isa::round_master};
  static const AdamKernels avx2{Isa::avx2, &avx2_isa::adam, &avx2_isa::roofline,
                                &avx2_isa::grad_stats, &avx2_isa::adam_compact,
                                &avx2_isa::roofline_compact, &avx2_isa::widen_bf16, &avx2_isa::round_master};
  static const AdamKernels avx512{Isa::avx512, &avx512_isa::adam, &avx512_isa::roofline,
                                  &avx512_isa::grad_stats, &avx512_isa::adam_compact,
                                  &avx512_isa::roofline_compact, &avx512_isa::widen_bf16, &avx512_isa::round_master};
  return kernels_for(isa, "the CPU Adam variant", scalar, avx2, avx512);
}

void require_isa(Isa isa, const char* what) {
  if (!cpu_supports(isa))
    throw Error(fmt::format("{} {} needs instructions this CPU lacks; use select_isa() to pick a supported one", what,
                            isa_name(isa)));
}

}  // namespace zest::optim
