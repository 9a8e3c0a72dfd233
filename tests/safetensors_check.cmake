# Runs a Python check (SCRIPT: tests/safetensors_check.py for zp.test.safetensors.python,
# tests/gpt_hf_check.py for zp.test.gpt.hf) with the interpreter cmake/install-deps.sh prepares,
# giving it the C++ program EXPORT, a fresh WORK directory and EXTRA (optional). IMPORTS: the
# modules the check needs, as Python's import statement lists them. Invoked by ctest with -DNAME,
# -DPYTHON, -DEXPORT, -DSCRIPT, -DWORK, -DIMPORTS [-DEXTRA].
set(fix "run `bash cmake/install-deps.sh tests`: it creates that virtual environment and pip-installs safetensors, torch and transformers from PyPI (needs network access), or configure with -DZP_TEST_PYTHON=<a python with ${IMPORTS}>")
if(NOT EXISTS "${PYTHON}")
  message(FATAL_ERROR "${NAME}: no Python at ${PYTHON}; ${fix}")
endif()
execute_process(COMMAND "${PYTHON}" -c "import ${IMPORTS}" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "${NAME}: ${PYTHON} cannot import ${IMPORTS}:\n${err}${fix}")
endif()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" "${EXPORT}" "${WORK}" ${EXTRA} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "${NAME}: ${SCRIPT} failed (${rc})")
endif()
