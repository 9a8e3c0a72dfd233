# Every public header compiles on its own (it includes what it uses): one translation unit per
# header, built with the tests, against the component that provides its dependencies. Device
# code builds for the simulated device here; nvcc builds the same headers in the .cu tests.
file(GLOB_RECURSE _zp_headers RELATIVE ${PROJECT_SOURCE_DIR}/include CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/include/zp/*.hpp)
set(_zp_header_groups "")
foreach(h IN LISTS _zp_headers)
  if(h MATCHES "^zp/backend/mpi")
    set(g mpi)
  elseif(h STREQUAL "zp/backend/nccl.hpp")
    set(g nccl)
  elseif(h STREQUAL "zp/async_file.hpp")
    set(g aio)
  elseif(h STREQUAL "zp/device/cuda.hpp")
    set(g cuda)
  elseif(h MATCHES "^zp/(device/|optim/gpu\\.hpp|backend/cuda_threads\\.hpp)")
    set(g sim)
  else()
    set(g io)
  endif()
  if(NOT TARGET zp::${g})
    continue()  # the component is not available on this machine
  endif()
  string(REGEX REPLACE "[/.]" "_" stem "${h}")
  set(tu ${CMAKE_CURRENT_BINARY_DIR}/headers/${stem}.cpp)
  file(CONFIGURE OUTPUT ${tu} CONTENT "#include \"${h}\"\n")
  list(APPEND _zp_header_tus_${g} ${tu})
  list(APPEND _zp_header_groups ${g})
endforeach()
list(REMOVE_DUPLICATES _zp_header_groups)
foreach(g IN LISTS _zp_header_groups)
  add_library(zp.headers.${g} OBJECT ${_zp_header_tus_${g}})
  target_link_libraries(zp.headers.${g} PRIVATE zp::io zp::${g})
  target_compile_options(zp.headers.${g} PRIVATE -Wall -Wextra -Wpedantic)
endforeach()

# The offline tool reads checkpoints without the engine: its translation unit must not include
# engine.hpp (nor the communicators the engine is built on).
if(TARGET zp_ckpt)
  # -MG: a header not found (nlohmann's, from wherever the package put it) still ends the list
  # of what the tool includes, without being searched for.
  add_test(NAME zp.test.tool.ckpt_includes
           COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -M -MG -I${PROJECT_SOURCE_DIR}/include
                   ${PROJECT_SOURCE_DIR}/tools/zp_ckpt.cpp)
  set_tests_properties(zp.test.tool.ckpt_includes PROPERTIES LABELS cpu
                       PASS_REGULAR_EXPRESSION "zp/checkpoint_format\\.hpp"
                       FAIL_REGULAR_EXPRESSION "zp/(engine|collective|checkpoint)\\.hpp")
endif()
