# tests/layers.cmake: README's layer table, enforced (ctest: zp.test.layers).
#   cmake -DZP_SOURCE_DIR=<zp checkout> [-DVERBOSE=ON] -P tests/layers.cmake
#
# Reads the table under "include/zp/" in README.md's Layout section, where each row is a layer
# number, its name and the headers it holds:
#     5 communication collective.hpp (...), work.hpp (...); backend/threads.hpp, mpi.hpp (...)
# and fails unless
#   - every header under include/zp is in the table, and every header the table names exists;
#   - no header is in two layers;
#   - every #include "zp/..." of every header names a header of the same layer or a lower one.
#
# How a row is read: its headers are the tokens ending in .hpp (continuation lines belong to the
# row above). A token with a directory (backend/threads.hpp) sets the row's directory, and a bare
# name after it is looked up there first, then at the top (so "backend/threads.hpp, mpi.hpp"
# means backend/mpi.hpp, and "backend/cuda_threads.hpp); agreement.hpp" means agreement.hpp). A
# token that is a directory ("detail/ (hashes, ...)") puts every header under it in that layer,
# unless the table names the header itself elsewhere (detail/reduce.hpp is in layer 5).
# zp.hpp, the umbrella header, is the top: it may include anything and nothing may include it.
cmake_minimum_required(VERSION 3.20)

if(NOT ZP_SOURCE_DIR)
  message(FATAL_ERROR "layers: pass -DZP_SOURCE_DIR=<the zp source tree>")
endif()
set(_readme "${ZP_SOURCE_DIR}/README.md")
set(_inc "${ZP_SOURCE_DIR}/include/zp")
if(NOT EXISTS "${_readme}" OR NOT IS_DIRECTORY "${_inc}")
  message(FATAL_ERROR "layers: ${ZP_SOURCE_DIR} has no README.md or include/zp")
endif()

set(_errors "")
macro(layer_error)
  string(CONCAT _msg ${ARGN})
  list(APPEND _errors "${_msg}")
endmacro()

# ---- the table ----------------------------------------------------------------------------
file(READ "${_readme}" _text)
# Line by line as a CMake list: characters that mean something to lists become harmless.
string(REPLACE ";" "," _text "${_text}")
string(REPLACE "[" "(" _text "${_text}")
string(REPLACE "]" ")" _text "${_text}")
string(REPLACE "\\" "/" _text "${_text}")
string(REPLACE "\n" ";" _lines "${_text}")

set(_state before)  # before -> layout (in the section) -> table -> done
set(_layer "")
set(_listed "")     # headers the table names, relative to include/zp
set(_dirs "")       # directories the table names as a whole ("detail")
set(_max_layer 0)
foreach(_line IN LISTS _lines)
  if(_state STREQUAL "before")
    if(_line MATCHES "^## Layout")
      set(_state layout)
    endif()
    continue()
  endif()
  if(_state STREQUAL "layout")
    if(_line MATCHES "^## ")
      break()
    elseif(_line MATCHES "^include/zp/ *$")
      set(_state table)
    endif()
    continue()
  endif()
  if(_state STREQUAL "done")
    break()
  endif()
  # In the table: rows and their continuation lines are indented; anything else ends it.
  if(_line STREQUAL "")
    continue()
  endif()
  if(NOT _line MATCHES "^ ")
    set(_state done)
    continue()
  endif()
  if(_line MATCHES "^ ? ? ?([0-9]+) +(.*)$")
    set(_layer "${CMAKE_MATCH_1}")
    set(_row "${CMAKE_MATCH_2}")
    set(_ctx "")  # the row's directory
    if(_layer GREATER _max_layer)
      set(_max_layer ${_layer})
    endif()
  elseif(_layer STREQUAL "")
    layer_error("README.md: a line of the layer table comes before any numbered row: \"${_line}\"")
    continue()
  else()
    set(_row "${_line}")
  endif()
  string(REGEX MATCHALL "[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*(\\.hpp|/)" _tokens "${_row}")
  foreach(_tok IN LISTS _tokens)
    if(_tok MATCHES "/$")  # a directory as a whole
      string(REGEX REPLACE "/$" "" _dir "${_tok}")
      if(IS_DIRECTORY "${_inc}/${_dir}")
        set(_ctx "${_dir}")
        if(NOT DEFINED _dir_layer_${_dir})
          set(_dir_layer_${_dir} ${_layer})
          list(APPEND _dirs "${_dir}")
        endif()
      endif()
      continue()
    endif()
    if(_tok MATCHES "/")
      set(_h "${_tok}")
      get_filename_component(_ctx "${_tok}" DIRECTORY)
    elseif(NOT _ctx STREQUAL "" AND EXISTS "${_inc}/${_ctx}/${_tok}")
      set(_h "${_ctx}/${_tok}")
    else()
      set(_h "${_tok}")
    endif()
    if(NOT EXISTS "${_inc}/${_h}")
      if(_tok MATCHES "/" OR _ctx STREQUAL "")
        layer_error("README.md: layer ${_layer} names ${_tok}, but include/zp/${_h} does not exist")
      else()
        layer_error("README.md: layer ${_layer} names ${_tok}, but neither include/zp/${_ctx}/${_tok} nor "
                    "include/zp/${_tok} exists")
      endif()
      continue()
    endif()
    if(DEFINED _layer_of_${_h})
      if(NOT _layer_of_${_h} EQUAL _layer)
        layer_error("README.md: ${_h} is in two layers, ${_layer_of_${_h}} and ${_layer}")
      endif()
      continue()
    endif()
    set(_layer_of_${_h} ${_layer})
    list(APPEND _listed "${_h}")
  endforeach()
endforeach()

if(_listed STREQUAL "")
  message(FATAL_ERROR "layers: found no layer table in ${_readme} (a fenced block under \"## Layout\" that "
                      "starts with the line \"include/zp/\", rows like \"  5 communication collective.hpp ...\")")
endif()

# ---- every header has a layer -------------------------------------------------------------
file(GLOB_RECURSE _headers RELATIVE "${_inc}" "${_inc}/*.hpp")
list(SORT _headers)
set(_top "zp.hpp")
math(EXPR _top_layer "${_max_layer} + 1")
set(_layer_of_${_top} ${_top_layer})
foreach(_h IN LISTS _headers)
  if(_h STREQUAL _top OR DEFINED _layer_of_${_h})
    continue()
  endif()
  foreach(_dir IN LISTS _dirs)
    string(LENGTH "${_dir}/" _n)
    string(SUBSTRING "${_h}" 0 ${_n} _prefix)
    if(_prefix STREQUAL "${_dir}/")
      set(_layer_of_${_h} ${_dir_layer_${_dir}})
      break()
    endif()
  endforeach()
  if(NOT DEFINED _layer_of_${_h})
    layer_error("include/zp/${_h} is not in README.md's layer table (Layout): add it to the row of its layer")
  endif()
endforeach()

# ---- every include goes down or sideways ----------------------------------------------------
set(_checked 0)
foreach(_h IN LISTS _headers)
  if(NOT DEFINED _layer_of_${_h})
    continue()  # reported above
  endif()
  file(STRINGS "${_inc}/${_h}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"zp/[^\"]+\"")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"zp/([^\"]+)\".*$" "\\1" _dep "${_line}")
    math(EXPR _checked "${_checked} + 1")
    if(NOT EXISTS "${_inc}/${_dep}")
      layer_error("include/zp/${_h} includes \"zp/${_dep}\", which does not exist")
    elseif(NOT DEFINED _layer_of_${_dep})
      continue()  # reported above as missing from the table
    elseif(_dep STREQUAL _top AND NOT _h STREQUAL _top)
      layer_error("include/zp/${_h} (layer ${_layer_of_${_h}}) includes \"zp/${_dep}\", the umbrella header above "
                  "every layer: include the headers it needs instead")
    elseif(_layer_of_${_dep} GREATER _layer_of_${_h})
      layer_error("include/zp/${_h} (layer ${_layer_of_${_h}}) includes \"zp/${_dep}\" (layer ${_layer_of_${_dep}}): "
                  "a header may include only headers of its own layer or below (README.md, Layout)")
    endif()
  endforeach()
endforeach()

if(VERBOSE)  # -DVERBOSE=ON: the table as read
  foreach(_h IN LISTS _headers)
    if(DEFINED _layer_of_${_h})
      message("layers: ${_layer_of_${_h}} ${_h}")
    endif()
  endforeach()
endif()

list(LENGTH _headers _nh)
list(LENGTH _errors _ne)
if(_ne GREATER 0)
  foreach(_e IN LISTS _errors)
    message("layers: ${_e}")
  endforeach()
  message(FATAL_ERROR "layers: ${_ne} problem(s) with README.md's layer table over ${_nh} headers")
endif()
message("layers: ${_nh} headers in ${_max_layer} layers (zp.hpp on top), ${_checked} includes, all of them "
        "to the same layer or below")
