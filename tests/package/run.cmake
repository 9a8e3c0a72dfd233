# Builds and runs tests/package/consumer against zp by add_subdirectory, FetchContent and
# find_package after install. Invoked by ctest with -DZP_SOURCE_DIR, -DZP_BUILD_DIR, -DWORK.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${ZP_BUILD_DIR} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "cmake --install of zp failed: ${rc}")
endif()
foreach(via subdir fetch find)
  set(b ${WORK}/${via})
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${ZP_SOURCE_DIR}/tests/package/consumer -B ${b}
                          -G Ninja -DZP_VIA=${via} -DZP_SOURCE_DIR=${ZP_SOURCE_DIR}
                          -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_BUILD_TYPE=Release
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc)
    message(FATAL_ERROR "configuring the consumer via ${via} failed:\n${out}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${b} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(rc)
    message(FATAL_ERROR "building the consumer via ${via} failed:\n${out}")
  endif()
  execute_process(COMMAND ${b}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc)
    message(FATAL_ERROR "the consumer built via ${via} failed:\n${out}")
  endif()
  if(NOT EXISTS ${b}/consumer_mpi)
    set(out "${out}(no zp::mpi: MPI not found)")
  endif()
  message(STATUS "via ${via}: ${out}")
endforeach()
