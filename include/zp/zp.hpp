// zp/zp.hpp: everything that builds with a plain C++20 compiler: the collectives and the threads
// backend, the ZeRO engine, the process grid with tensor- and pipeline-parallel pieces, the CPU
// optimizers, the loss scaler and the LR schedules. The mpi
// and nccl backends, the CUDA kernels and the zp::io headers (checkpoints, safetensors,
// ds_config) have their own (README.md, "Using zp").
#pragma once

#include "zp/agreement.hpp"
#include "zp/backend/threads.hpp"
#include "zp/bucket.hpp"
#include "zp/collective.hpp"
#include "zp/config.hpp"
#include "zp/dispatch.hpp"
#include "zp/dtype.hpp"
#include "zp/engine.hpp"
#include "zp/engine_config.hpp"
#include "zp/error.hpp"
#include "zp/grid.hpp"
#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/module_guard.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/param_coordinator.hpp"
#include "zp/partition.hpp"
#include "zp/pipeline.hpp"
#include "zp/precision.hpp"
#include "zp/quantize.hpp"
#include "zp/quantized_collectives.hpp"
#include "zp/schedule.hpp"
#include "zp/shard_step.hpp"
#include "zp/step_gate.hpp"
#include "zp/step_timer.hpp"
#include "zp/tensor_parallel.hpp"
#include "zp/whole_model.hpp"
#include "zp/work.hpp"
