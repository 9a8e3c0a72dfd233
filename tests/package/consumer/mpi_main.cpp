// Proves zp::mpi carries MPI's include path and libraries to a consumer.
#include <zp/backend/mpi.hpp>

static_assert(zp::Backend<zp::backend::Mpi>);

int main(int argc, char** argv) {
  zp::backend::MpiEnvironment env(&argc, &argv);
  zp::Collective<zp::backend::Mpi> comm{env.world()};
  float x = 1.0f;
  comm.all_reduce(std::span<float>(&x, 1));
  return x == float(comm.size()) ? 0 : 1;
}
