# cmake -DCMD=<program;args...> [-DEXPECT=<text>] -P loss_falls.cmake: runs a demo and passes
# only if it exits 0, its summary line "summary: loss A -> B" has B < A (the model learned
# something) and its output holds EXPECT.
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the demo exited with ${rc}")
endif()
if(NOT out MATCHES "summary: loss ([0-9.]+) -> ([0-9.]+)")
  message(FATAL_ERROR "no summary line in the demo's output")
endif()
if(NOT CMAKE_MATCH_2 LESS CMAKE_MATCH_1)
  message(FATAL_ERROR "the loss did not fall: ${CMAKE_MATCH_1} -> ${CMAKE_MATCH_2}")
endif()
if(DEFINED EXPECT AND NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "the demo's output does not say '${EXPECT}'")
endif()
