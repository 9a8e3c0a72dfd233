// The device engine test (engine_device.test.cpp) built with nvcc for a GPU, with the nccl
// backend besides cuda_threads.
#include "engine_device.test.cpp"
