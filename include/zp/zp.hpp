// zp/zp.hpp: everything that builds with a plain C++20 compiler (no MPI, CUDA or NCCL headers).
#pragma once

#include "zp/backend/threads.hpp"
#include "zp/collective.hpp"
#include "zp/config.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"
