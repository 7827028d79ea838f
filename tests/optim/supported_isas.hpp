// The CPU kernel variants this machine runs, for the tests that check each one.
#pragma once

#include <vector>

#include "optim/adam_kernels.hpp"

namespace zest::optim::test {

inline std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (cpu_supports(isa)) isas.push_back(isa);
  return isas;
}

}  // namespace zest::optim::test
