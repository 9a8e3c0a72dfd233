# Runs a Python check (SCRIPT: tests/safetensors_check.py for zp.test.safetensors.python,
# tests/gpt_hf_check.py for zp.test.gpt.hf) with the interpreter cmake/install-deps.sh prepares,
# giving it the C++ program EXPORT, a fresh WORK directory and EXTRA (optional). Invoked by
# ctest with -DNAME, -DPYTHON, -DEXPORT, -DSCRIPT, -DWORK [-DEXTRA].
set(fix "run cmake/install-deps.sh: it creates that virtual environment and pip-installs safetensors from PyPI (needs network access), or configure with -DZP_TEST_PYTHON=<a python with numpy and safetensors>")
if(NOT EXISTS "${PYTHON}")
  message(FATAL_ERROR "${NAME}: no Python at ${PYTHON}; ${fix}")
endif()
execute_process(COMMAND "${PYTHON}" -c "import numpy, safetensors" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "${NAME}: ${PYTHON} cannot import numpy and safetensors:\n${err}${fix}")
endif()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" "${EXPORT}" "${WORK}" ${EXTRA} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "${NAME}: ${SCRIPT} failed (${rc})")
endif()
