// zp_demo_gpu: the device demo (charlm_device.cpp) built with nvcc, for a GPU.
#include "charlm_device.cpp"
