// The device quantization tests (quantize_device.test.cpp) built with nvcc, for a GPU.
#include "quantize_device.test.cpp"
