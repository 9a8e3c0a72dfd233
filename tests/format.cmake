# zp.test.format: every C++ and CUDA source of zp is as .clang-format lays it out. Run by ctest
# with -DZP_SOURCE_DIR and -DCLANG_FORMAT; reports itself skipped (exit 77) when the clang-format
# found is not version 14 (another version lays code out differently).
execute_process(COMMAND ${CLANG_FORMAT} --version OUTPUT_VARIABLE version RESULT_VARIABLE rc)
if(rc OR NOT version MATCHES "version 14\\.")
  message("format: skipped: needs clang-format 14 (Debian 12's), found: ${CLANG_FORMAT} ${version}")
  cmake_language(EXIT 77)
endif()
file(GLOB_RECURSE sources RELATIVE ${ZP_SOURCE_DIR}
     ${ZP_SOURCE_DIR}/include/*.hpp ${ZP_SOURCE_DIR}/include/*.cuh
     ${ZP_SOURCE_DIR}/tests/*.hpp ${ZP_SOURCE_DIR}/tests/*.cpp ${ZP_SOURCE_DIR}/tests/*.cu
     ${ZP_SOURCE_DIR}/examples/*.hpp ${ZP_SOURCE_DIR}/examples/*.cpp ${ZP_SOURCE_DIR}/examples/*.cu
     ${ZP_SOURCE_DIR}/bench/*.hpp ${ZP_SOURCE_DIR}/bench/*.cpp ${ZP_SOURCE_DIR}/bench/*.cu
     ${ZP_SOURCE_DIR}/tools/*.hpp ${ZP_SOURCE_DIR}/tools/*.cpp)
execute_process(COMMAND ${CLANG_FORMAT} --dry-run --Werror ${sources} WORKING_DIRECTORY ${ZP_SOURCE_DIR}
                RESULT_VARIABLE rc ERROR_VARIABLE out)
if(rc)
  string(REGEX MATCHALL "[^\n]*: error: code should be clang-formatted[^\n]*" bad "${out}")
  list(LENGTH bad n)
  list(JOIN bad "\n" shown)
  message(FATAL_ERROR "format: ${n} places are not laid out as .clang-format says (run "
                      "clang-format -i on the files named; Debian's clang-format 14):\n${shown}")
endif()
list(LENGTH sources n)
message("format: ${n} files as .clang-format lays them out")
