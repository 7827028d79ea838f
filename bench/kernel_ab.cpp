// Two versions of the CPU Adam kernel source in one program (bench/kernel_ab.sh compiles
// src/optim/adam_kernels.cpp at a base revision into namespace base_ns and the working tree's into
// work_ns): each round times the base's compact step, the working tree's, and the working tree's
// roofline pass on the same arrays, so machine drift lands on both alike. Prints the medians and
// the per-round speed ratio (work / base) with its spread.
//   kernel_ab STATES PARAMS ROUNDS     (STATES: int8 or bf16; fp32 gradients, one thread)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "optim/adam_kernels.hpp"

namespace zest::optim {
namespace base_ns {
void adam_compact(const CompactAdamRange&, const AdamCoefficients&, const StateRounding&);
}
namespace work_ns {
void adam_compact(const CompactAdamRange&, const AdamCoefficients&, const StateRounding&);
void roofline_compact(const CompactAdamRange&);
}  // namespace work_ns
}  // namespace zest::optim

namespace {

using namespace zest::optim;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 || (std::strcmp(argv[1], "int8") != 0 && std::strcmp(argv[1], "bf16") != 0)) {
    std::fprintf(stderr, "usage: kernel_ab int8|bf16 PARAMS ROUNDS\n");
    return 2;
  }
  const bool int8 = std::strcmp(argv[1], "int8") == 0;
  const std::size_t n = std::strtoull(argv[2], nullptr, 10);
  const int rounds = std::atoi(argv[3]);
  if (n == 0 || n > (std::size_t{1} << 32) || rounds < 1 || rounds > 1000) {
    std::fprintf(stderr, "kernel_ab: PARAMS must lie in 1..2^32 and ROUNDS in 1..1000\n");
    return 2;
  }
  std::vector<float> p(n), g(n), m_scale(n / kInt8Block + 1), v_scale(n / kInt8Block + 1);
  std::vector<std::uint16_t> m(n), v(n);  // int8 uses the first n bytes of each
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : p) x = normal(rng);
  for (float& x : g) x = normal(rng) * 1e-3f;
  static const DynamicCode m_code = make_dynamic_code(true);
  static const DynamicCode v_code = make_dynamic_code(false);
  CompactAdamRange r;
  r.master = p.data();
  r.m = m.data();
  r.v = v.data();
  r.states = int8 ? zest::StatesFormat::int8 : zest::StatesFormat::bf16;
  r.m_scale = m_scale.data();
  r.v_scale = v_scale.data();
  r.m_code = &m_code;
  r.v_code = &v_code;
  r.grad = g.data();
  r.count = n;
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  const AdamCoefficients c = make_adam_coefficients(hp, 3);
  const auto time = [&](auto&& run) {
    const auto start = Clock::now();
    run();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  for (int i = 0; i < 2; ++i) {  // warm-up: pages touched, states away from 0
    base_ns::adam_compact(r, c, {1});
    work_ns::adam_compact(r, c, {1});
  }
  std::vector<double> base, work, roof, ratio;
  for (int k = 0; k < rounds; ++k) {
    base.push_back(time([&] { base_ns::adam_compact(r, c, {static_cast<std::uint64_t>(k)}); }));
    work.push_back(time([&] { work_ns::adam_compact(r, c, {static_cast<std::uint64_t>(k)}); }));
    roof.push_back(time([&] { work_ns::roofline_compact(r); }));
    ratio.push_back(base.back() / work.back());
  }
  std::printf("%s states, %zu params, %d rounds, 1 thread\n", argv[1], n, rounds);
  std::printf("  base     %.3e params/s, %.3f of the roofline\n", n / median(base), median(roof) / median(base));
  std::printf("  work     %.3e params/s, %.3f of the roofline\n", n / median(work), median(roof) / median(work));
  std::printf("  roofline %.3e params/s\n", n / median(roof));
  std::sort(ratio.begin(), ratio.end());
  std::printf("  work / base speed, per round: median %.3f (%.3f-%.3f)\n", ratio[ratio.size() / 2], ratio.front(),
              ratio.back());
}
