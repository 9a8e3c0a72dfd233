// The cuda_threads tests (cuda_threads.test.cpp) built with nvcc, for a GPU.
#include "cuda_threads.test.cpp"
