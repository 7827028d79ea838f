// The world a build knows and the Runtime over it: MPI's ranks where zest was built with MPI (run
// alone here), else one process that refuses to be one of several launched ranks. Either way a
// trainer's host scalars are reduced through Runtime::comm() without a stream or device buffer.
#include "runtime/comm/world.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "zest/error.hpp"
#include "zest/runtime.hpp"

#if ZEST_TEST_HAVE_MPI
#include <mpi.h>
#endif

namespace zest {
namespace {

Config cpu_config() {
  Config config;
  config.device.type = DeviceType::cpu;
  config.device.memory = std::size_t{64} << 20;
  return config;
}

TEST(World, RanksAreTheLaunchersOrOne) {
  const std::unique_ptr<World> world = make_world();
#if ZEST_TEST_HAVE_MPI
  int rank = -1, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(world->rank(), rank);
  EXPECT_EQ(world->size(), size);
#else
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->local_rank(), 0);
  EXPECT_EQ(world->local_size(), 1);
#endif
}

TEST(World, RuntimeReducesHostScalarsAcrossTheWorld) {
  Runtime runtime(cpu_config());
#if ZEST_TEST_HAVE_MPI
  EXPECT_EQ(runtime.comm().backend_name(), "mpi");
#else
  EXPECT_EQ(runtime.comm().backend_name(), "local");
  EXPECT_EQ(runtime.world_size(), 1);
#endif
  const int n = runtime.world_size();
  std::vector<double> loss = {0.5 * (runtime.rank() + 1), 1.0};
  std::vector<std::int64_t> tokens = {runtime.rank() + 1};
  runtime.comm().all_reduce_host(loss, ReduceOp::sum);
  runtime.comm().all_reduce_host(tokens, ReduceOp::max);
  EXPECT_DOUBLE_EQ(loss[0], 0.25 * n * (n + 1));
  EXPECT_DOUBLE_EQ(loss[1], n);
  EXPECT_EQ(tokens[0], n);
}

#if !ZEST_TEST_HAVE_MPI
// Each of several launched ranks would otherwise train alone, silently.
TEST(World, WithoutMpiRefusesToBeOneOfSeveralLaunchedRanks) {
  const char* previous = std::getenv("OMPI_COMM_WORLD_SIZE");
  const std::string saved = previous ? previous : "";
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  try {
    static_cast<void>(make_world());
    ADD_FAILURE() << "no SystemError";
  } catch (const SystemError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("one of 3 ranks"), std::string::npos) << what;
    EXPECT_NE(what.find("-Dmpi=enabled"), std::string::npos) << what;
  }
  if (previous) {
    setenv("OMPI_COMM_WORLD_SIZE", saved.c_str(), 1);
  } else {
    unsetenv("OMPI_COMM_WORLD_SIZE");
  }
}
#endif

}  // namespace
}  // namespace zest
