// The main of a doctest program run under mpiexec: one run seed for every process (rank 0's,
// zp::test::run_seed, printed there with how to repeat the run) and doctest's report from rank 0
// only.
//   int main(int argc, char** argv) { return zp::test::mpi_main(argc, argv, "my_mpi.test"); }
#pragma once

#include <doctest/doctest.h>

#include <cstdint>

#include "random.hpp"
#include "seed_report.hpp"
#include "zp/backend/mpi.hpp"

namespace zp::test {

// The run's seed, the same in every process (set by mpi_main).
inline std::uint64_t& mpi_seed() {
  static std::uint64_t s = 0;
  return s;
}

inline int mpi_main(int argc, char** argv, const char* program) {
  zp::backend::MpiEnvironment env(&argc, &argv);
  std::uint64_t s = env.world_rank() == 0 ? run_seed(program) : 0;
  MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);  // every process trains on rank 0's data
  mpi_seed() = s;
  doctest::Context ctx(argc, argv);
  if (env.world_rank() != 0) ctx.setOption("minimal", true);
  return ctx.run();
}

}  // namespace zp::test
