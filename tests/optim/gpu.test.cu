// The device optimizer tests (gpu.test.cpp) built with nvcc, for a GPU.
#include "gpu.test.cpp"
