# Builds and runs tests/package/consumer against zp by add_subdirectory, FetchContent and
# find_package (after install, and from zp's build tree), and checks zp's packaging:
#   - a freshly configured zp installs with no build step (the usual header-only install);
#   - a consumer that takes zp by FetchContent installs and exports its own target linking
#     zp::zp, while zp's own files stay out of that install unless asked for (component zp).
# Invoked by ctest with -DZP_SOURCE_DIR, -DZP_BUILD_DIR, -DWORK, and -Dnlohmann_json_DIR so the
# fresh zp finds what the build under test found (and so defines zp_ckpt, installed only if built).
file(REMOVE_RECURSE ${WORK})

# zp_run(<what> COMMAND ...): runs the command; its output in `out`, the test fails if it fails.
function(zp_run what)
  execute_process(${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc)
    message(FATAL_ERROR "${what} failed: ${rc}\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

# consumer(<name> <target> <cmake args>...): configures the consumer into ${WORK}/<name>, builds
# <target> (all, or only the consumer where the extra targets prove nothing new) and runs it.
# A Release build without -O3: the packaging is under test, not the optimizer (-O3 made each
# build half as long again).
function(consumer name target)
  set(b ${WORK}/${name})
  zp_run("configuring the consumer (${name})"
         COMMAND ${CMAKE_COMMAND} -S ${ZP_SOURCE_DIR}/tests/package/consumer -B ${b} -G Ninja
                 -DZP_SOURCE_DIR=${ZP_SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release
                 "-DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG" ${ARGN})
  zp_run("building the consumer (${name})" COMMAND ${CMAKE_COMMAND} --build ${b} --target ${target})
  zp_run("the consumer built via ${name}" COMMAND ${b}/consumer)
  set(said "${out}")
  if(target STREQUAL "all" AND NOT EXISTS ${b}/consumer_mpi)
    string(APPEND said "(no zp::mpi: MPI not found)")
  endif()
  if(EXISTS ${b}/consumer_aio)
    zp_run("the aio consumer built via ${name}" COMMAND ${b}/consumer_aio WORKING_DIRECTORY ${b})
    string(APPEND said "${out}")
  elseif(target STREQUAL "all")
    string(APPEND said "(no zp::aio: liburing not found)")
  endif()
  message(STATUS "via ${name}: ${said}")
endfunction()

# The build under test, installed (with zp_ckpt where it was built).
zp_run("cmake --install of zp" COMMAND ${CMAKE_COMMAND} --install ${ZP_BUILD_DIR} --prefix ${WORK}/prefix)

# Configure and install, no build in between.
set(fresh_args -DZP_BUILD_TESTS=OFF -DZP_BUILD_BENCH=OFF -DZP_BUILD_EXAMPLES=OFF)
if(nlohmann_json_DIR)
  list(APPEND fresh_args -Dnlohmann_json_DIR=${nlohmann_json_DIR})
endif()
zp_run("configuring zp afresh" COMMAND ${CMAKE_COMMAND} -S ${ZP_SOURCE_DIR} -B ${WORK}/zp -G Ninja
                                       -DCMAKE_BUILD_TYPE=Release ${fresh_args})
zp_run("cmake --install of a configured, unbuilt zp"
       COMMAND ${CMAKE_COMMAND} --install ${WORK}/zp --prefix ${WORK}/prefix-unbuilt)
if(EXISTS ${WORK}/zp/tools/cmake_install.cmake)
  file(READ ${WORK}/zp/tools/cmake_install.cmake rules)
  if(rules MATCHES "zp_ckpt")
    message(STATUS "unbuilt zp installed, without zp_ckpt, which it defines but did not build")
  endif()
endif()

# Each install holds every header of the source tree, and nothing else under include/zp.
file(GLOB_RECURSE headers RELATIVE ${ZP_SOURCE_DIR}/include ${ZP_SOURCE_DIR}/include/zp/*)
foreach(prefix ${WORK}/prefix ${WORK}/prefix-unbuilt)
  file(GLOB_RECURSE installed RELATIVE ${prefix}/include ${prefix}/include/zp/*)
  if(NOT installed STREQUAL headers)
    message(FATAL_ERROR "${prefix}/include holds\n  ${installed}\nnot zp's headers\n  ${headers}")
  endif()
endforeach()

# The full program through zp's own target definitions and through the installed package;
# zp::mpi and zp::aio through the package, whose config finds their dependencies again (zp's own
# tests build them from the target definitions).
consumer(subdir consumer -DZP_VIA=subdir)
consumer(find all -DZP_VIA=find -DCMAKE_PREFIX_PATH=${WORK}/prefix)
# These differ from the above in where the package comes from, not in the target (FetchContent
# adds zp as add_subdirectory does): the light consumer is enough.
consumer(fetch consumer -DZP_VIA=fetch -DCONSUMER_LIGHT=ON)
consumer(find-unbuilt consumer -DZP_VIA=find -DCMAKE_PREFIX_PATH=${WORK}/prefix-unbuilt
         -DCONSUMER_LIGHT=ON)
consumer(find-build-tree consumer -DZP_VIA=find -Dzp_DIR=${ZP_BUILD_DIR} -DCONSUMER_LIGHT=ON)

# A consumer with its own export set: its install has its package and not zp's, which the
# component zp adds.
consumer(fetch-install consumer -DZP_VIA=fetch -DCONSUMER_INSTALL=ON -DCONSUMER_LIGHT=ON)
set(p ${WORK}/consumer-prefix)
zp_run("cmake --install of the consumer"
       COMMAND ${CMAKE_COMMAND} --install ${WORK}/fetch-install --prefix ${p})
if(NOT EXISTS ${p}/lib/cmake/consumer/consumerTargets.cmake OR EXISTS ${p}/include/zp)
  message(FATAL_ERROR "the consumer's install should hold consumerTargets.cmake and no zp headers")
endif()
zp_run("cmake --install --component zp of the consumer"
       COMMAND ${CMAKE_COMMAND} --install ${WORK}/fetch-install --prefix ${p} --component zp)
if(NOT EXISTS ${p}/include/zp/zp.hpp OR NOT EXISTS ${p}/share/zp/cmake/zpTargets.cmake)
  message(FATAL_ERROR "cmake --install --component zp should install zp's headers and package")
endif()
message(STATUS "via fetch-install: the consumer installed its export set; zp's with --component zp")
