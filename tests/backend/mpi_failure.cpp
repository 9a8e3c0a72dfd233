// Provokes the mpi backend's failure paths; ctest checks the message on stderr
// (tests/CMakeLists.txt) and that the job ends well within its TIMEOUT instead of hanging.
//   mpi_failure throw   rank 1 throws before the third collective while the others wait in it:
//                       its backend, destroyed during unwinding, aborts the job naming rank 1.
//   mpi_failure error   the same with a zp::Error: the abort also gives its message, which no
//                       handler could print (the abort ends the process first).
//   mpi_failure silent  rank 1 skips the third collective (and stays busy): the others' watchdog
//                       aborts the job after the 1.5 s timeout, naming the operation.
//   mpi_failure recv    rank 0 receives from rank 1, which never sends (a pipeline stage that
//                       died): the watchdog aborts the job after the timeout, naming the recv
//                       and the peer.
//   mpi_failure kill    rank 1 is killed (SIGKILL) while the others wait for it in the third
//                       collective, inside the node's shared segment: the job ends naming rank 1
//                       well before the timeout (mpi_kill.sh also checks no segment is left).
//   mpi_failure segment a node's shared segment larger than the memory cgroup it runs in
//                       (tests/in_cgroup.sh): an error on every rank naming the cgroup, where
//                       reserving it got the job killed.
//   mpi_failure pid_namespaces  each rank run in a PID namespace of its own
//                       (mpi_pid_namespaces.sh): making the communicator, with the node's
//                       shared segment, is an error on every rank naming the cause; without the
//                       segment the collectives run.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "zp/backend/mpi.hpp"

int main(int argc, char** argv) {
  zp::backend::MpiEnvironment env(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "pid_namespaces") {
    try {
      zp::backend::Mpi(MPI_COMM_WORLD, {});
      std::printf("unexpected: the node's shared segment was made\n");
      return 1;
    } catch (const zp::Error& e) {
      std::printf("refused: %s\n", e.what());
    }
    zp::backend::Mpi::Options opt;
    opt.shared_memory = false;
    zp::Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, opt)};
    std::vector<float> a(1000, float(comm.rank() + 1));
    comm.all_reduce(std::span<float>(a));
    const float want = float(comm.size() * (comm.size() + 1) / 2);
    for (float x : a)
      if (x != want) {
        std::printf("unexpected: all_reduce gave %g, not %g\n", double(x), double(want));
        return 1;
      }
    std::printf("without the segment: all_reduce ok on rank %d\n", comm.rank());
    return 0;
  }
  if (mode == "segment") {
    try {
      zp::backend::Mpi::Options opt;
      opt.node_chunk_bytes = std::size_t(64) << 20;  // 2 areas a rank: 256 MiB on 2 ranks
      zp::backend::Mpi(MPI_COMM_WORLD, opt);
      std::printf("unexpected: the node's shared segment was made\n");
      return 1;
    } catch (const zp::Error& e) {
      std::printf("refused: %s\n", e.what());
      return 0;
    }
  }
  try {
    zp::backend::Mpi::Options opt;
    opt.timeout = std::chrono::milliseconds(mode == "kill" ? 20000 : 1500);
    zp::Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, opt)};
    std::vector<float> a(1000, 1.0f);
    comm.all_reduce(std::span<float>(a));  // call #1
    comm.barrier();                        // call #2
    if (comm.rank() == 1 && mode == "throw") throw std::runtime_error("loss exploded on rank 1");
    if (comm.rank() == 1 && mode == "error")
      throw zp::Error(zp::Errc::io, "nvme_path '/scratch' is full (rank 1)");
    if (comm.rank() == 1 && mode == "kill") {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the others are waiting
      raise(SIGKILL);
    }
    if (comm.rank() == 1 && (mode == "silent" || mode == "recv")) {
      std::this_thread::sleep_for(std::chrono::seconds(40));
      return 0;
    }
    if (mode == "recv") {
      if (comm.rank() == 0) comm.recv(std::span<float>(a), 1);  // call #3
      std::this_thread::sleep_for(std::chrono::seconds(40));    // the other ranks: idle, not in zp
      return 0;
    }
    comm.all_reduce(std::span<float>(a));  // call #3
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
  std::printf("unexpected: the collective completed\n");
  return 0;
}
