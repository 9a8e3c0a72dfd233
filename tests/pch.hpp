// The precompiled header of Clang builds' test programs (tests/CMakeLists.txt): what most of them
// parse, compiled once per build. Only headers that no configuration macro reaches (zp::sim's
// ZP_DEVICE_SIM, zp::aio's ZP_WITH_AIO: tests/CMakeLists.txt checks it), since a program that
// defines one reuses it as compiled without; nothing of doctest, which main.cpp and the MPI tests
// include after their DOCTEST_CONFIG_ macros.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zp/backend/threads.hpp"
#include "zp/collective.hpp"
#include "zp/grid.hpp"
#include "zp/model.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/quantize.hpp"
#if __has_include(<nlohmann/json.hpp>)
#include "zp/checkpoint_format.hpp"
#endif
