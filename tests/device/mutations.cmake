# The mutation table (issue #18): every ordering of zp's device code (an event record or wait, a
# host synchronisation, a stream-ordered free; their `site` names in the headers) with the test
# that fails when it is removed. Each row runs that test on the simulated device with the site
# dropped (ZP_SIM_DROP) under the given scheduler seed and passes only if the test reports wrong
# values, a crash or a sanitizer error. A site no test catches is either unnecessary (removed:
# offload's per-segment upload wait, which the next gradient fetch already orders) or gets a test.
# The nccl backend's sites (nccl.ready, nccl.work.record, nccl.work.wait) need NCCL itself and are
# exercised on a GPU only (tools/gpu_check.sh, the delayed-stream runs of engine_device.cuda).
#
#   site                       test (tests/...)             test case             seed  caught as
set(ZP_MUTATIONS
  "buffer.free|engine_device|*equals the CPU engine*<float>|1"              # wrong master weights and parameters
  "to_host.sync|device.memory|to_host*|1"                                   # the host reads the pinned buffer before the copy: wrong values
  "offload.down.record|device.memory|offload*|1"                            # stale gradients in the CPU step: wrong values
  "offload.down.sync|device.memory|offload*|1"                              # the same
  "offload.up.record|device.memory|offload*|1"                              # grow and free wait for no upload: wrong values copied from freed memory
  "offload.grow.sync|device.memory|offload*|1"                              # buffers freed under an upload: wrong values
  "offload.free.sync|device.memory|offload*|1"                              # the same at destruction
  "pinned.free.sync|device.memory|*pinned*|1"                               # a copy into freed page-locked memory: the stream still runs, or a crash
  "cuda_threads.ready.record|backend.cuda_threads|*delayed*|1"              # peers read inputs not yet written
  "cuda_threads.ready.wait|backend.cuda_threads|*delayed*|1"                # the same
  "cuda_threads.done.record|backend.cuda_threads|*delayed*|1"               # outputs read before peers wrote them
  "cuda_threads.done.wait|backend.cuda_threads|*delayed*|1"                 # the same
  "cuda_threads.work.record|backend.cuda_threads|*delayed*|1"               # compute stream not held back
  "cuda_threads.work.wait|backend.cuda_threads|*delayed*|1"                 # the same
)
foreach(row IN LISTS ZP_MUTATIONS)
  string(REPLACE "|" ";" f "${row}")
  list(GET f 0 site)
  list(GET f 1 test)
  list(GET f 2 case)
  list(GET f 3 seed)
  # Through a shell: a test killed by the signal it reports (doctest's "test case CRASHED") must
  # still be judged by its output, which ctest does not do for a process that died of a signal.
  # Its TMPDIR is a directory of its own, removed after the run: a test that crashes leaves its
  # temporary directories behind.
  add_test(NAME zp.mutation.${site}
           COMMAND sh -c "mkdir -p \"$1\" && TMPDIR=\"$1\" \"$0\" \"$2\"; rm -rf \"$1\"; exit 0"
                   $<TARGET_FILE:zp.test.${test}> ${CMAKE_CURRENT_BINARY_DIR}/mutation.${site}.tmp
                   -tc=${case})
  set_tests_properties(zp.mutation.${site} PROPERTIES LABELS "sim;mutation" TIMEOUT 120
    ENVIRONMENT "ZP_SIM_DROP=${site};ZP_SIM_SEED=${seed}"
    PASS_REGULAR_EXPRESSION "is NOT correct|test case CRASHED|Sanitizer")
endforeach()
