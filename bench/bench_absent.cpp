// `zest bench` in a build configured with -Dbench=false (scripts/test.sh's sanitizer build, which
// skips the benchmarks' suite and so need not compile them): each benchmark says how to get it.
#include <cstdio>

#include "bench_commands.hpp"

namespace zest::cli {
namespace {

int absent(const char* name) {
  std::fprintf(stderr,
               "zest bench %s: this zest was built without its benchmarks (meson -Dbench=false); "
               "reconfigure with -Dbench=true to run them\n",
               name);
  return 2;
}

}  // namespace

int bench_adam(int, char**) { return absent("adam"); }
int bench_io(int, char**) { return absent("io"); }
int bench_memory(int, char**) { return absent("memory"); }
int bench_step(int, char**) { return absent("step"); }

}  // namespace zest::cli
