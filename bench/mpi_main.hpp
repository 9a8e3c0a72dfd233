// bench/mpi_main.hpp: the main of a benchmark binary that also runs under mpirun. Under a
// launcher with >= 2 ranks it registers only its MPI benchmarks (idle ranks polling in MPI would
// distort the single-process ones); every rank runs the same list with fixed iteration counts,
// so the collectives match, and rank 0 alone reports.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <vector>

#if ZP_BENCH_MPI
#include <zp/backend/mpi.hpp>
#endif

namespace zp::bench {

// Launched by mpirun/mpiexec/srun? (Initialising MPI otherwise would need a singleton launch.)
inline bool under_mpi_launcher() {
  for (const char* v :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_PROCID"})
    if (std::getenv(v)) return true;
  return false;
}

// Rank != 0 under MPI: runs everything, prints nothing.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// register_mpi(N) under a launcher with N >= 2 ranks, else register_local().
template <class Mpi, class Local>
int mpi_main(int argc, char** argv, Mpi&& register_mpi, Local&& register_local) {
  int mpi_size = 1, mpi_rank = 0;
#if ZP_BENCH_MPI
  std::unique_ptr<zp::backend::MpiEnvironment> env;
  if (under_mpi_launcher()) {
    env = std::make_unique<zp::backend::MpiEnvironment>(&argc, &argv);
    mpi_size = env->world_size();
    mpi_rank = env->world_rank();
  }
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (mpi_size >= 2)
    register_mpi(mpi_size);
  else
    register_local();
  if (mpi_rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter null;
    benchmark::RunSpecifiedBenchmarks(&null);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace zp::bench
