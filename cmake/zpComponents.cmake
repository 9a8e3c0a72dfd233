# The zp targets. Shared by the source tree (add_subdirectory, FetchContent) and, through
# zpConfig.cmake, by an installed zp, so the three ways of getting zp define the same names.
#   zp::zp    header-only core, C++20, host backends (threads)
#   zp::mpi   + the mpi backend (MPI::MPI_CXX)
#   zp::io    + checkpoints, safetensors and DeepSpeed configs (nlohmann_json)
#   zp::aio   + asynchronous file I/O for large transfers (zp/async_file.hpp: io_uring, liburing)
#               and with it the optimizer state on NVMe (zp/swap.hpp; defines ZP_WITH_AIO, which
#               must then hold for every file of the program)
#   zp::cuda  + CUDA runtime (the device primitives and memory space; kernels built by nvcc)
#   zp::nccl  + the nccl backend (zp::cuda and NCCL)
#   zp::sim   + the simulated device (zp/device/sim.hpp): zp's device code built with any C++
#               compiler, each stream a thread; for tests and for debugging stream ordering
include_guard(GLOBAL)
include(GNUInstallDirs)
find_package(Threads REQUIRED)

# zp_component(<name> <what it links>...): the INTERFACE target zp_<name>, zp::<name> here and
# <name> in the export set.
function(zp_component name)
  add_library(zp_${name} INTERFACE)
  add_library(zp::${name} ALIAS zp_${name})
  target_link_libraries(zp_${name} INTERFACE ${ARGN})
  set_target_properties(zp_${name} PROPERTIES EXPORT_NAME ${name})
endfunction()

if(NOT TARGET zp)
  add_library(zp INTERFACE)
  add_library(zp::zp ALIAS zp)
  target_include_directories(zp INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                          $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_features(zp INTERFACE cxx_std_20)
  target_link_libraries(zp INTERFACE Threads::Threads)
endif()

if(NOT TARGET zp_sim)
  zp_component(sim zp)
  target_compile_definitions(zp_sim INTERFACE ZP_DEVICE_SIM=1)
endif()

if(ZP_ENABLE_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    zp_component(mpi zp MPI::MPI_CXX)
    target_compile_definitions(zp_mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
  endif()
endif()

if(ZP_ENABLE_IO)
  find_package(nlohmann_json 3.10 QUIET)
  if(nlohmann_json_FOUND)
    zp_component(io zp nlohmann_json::nlohmann_json)
  endif()
endif()

if(ZP_ENABLE_AIO)
  find_package(Liburing QUIET)
  if(Liburing_FOUND)
    zp_component(aio zp Liburing::Liburing)
    target_compile_definitions(zp_aio INTERFACE ZP_WITH_AIO=1)  # swap.hpp: optimizer state on NVMe
  endif()
endif()

if(ZP_ENABLE_CUDA)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    zp_component(cuda zp CUDA::cudart)
    find_package(NCCL QUIET)
    if(NCCL_FOUND)
      zp_component(nccl zp_cuda NCCL::NCCL)
    endif()
  endif()
endif()
