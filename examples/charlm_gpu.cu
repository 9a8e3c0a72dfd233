// zp_demo_gpu: zp_demo's character-level language model on a GPU (nvcc): the same model,
// parameter names, data and progress line, with its forward and backward as CUDA (cuBLAS for the
// matrix products, small kernels for the rest), trained by the same engine on device memory.
//
//   zp_demo_gpu [--backend cuda_threads|nccl] [--ranks N] [--stage 0-3] [--precision fp32|bf16]
//               [--offload cpu|none] [--accum N] [--steps N] [--micro-batch N] [--lr X]
//               [--log-every N] [--text PATH]... [--embed N] [--context N] [--hidden N]
//
// --backend cuda_threads (default): N ranks as threads on one GPU (zp/backend/cuda_threads.cuh).
// --backend nccl: one process per GPU under mpirun (zp::backend::nccl_from_mpi).
// Sizes are flags so the model can fill a GPU (e.g. --hidden 8192 --micro-batch 1024).
// Every kernel runs on the rank's compute stream (zp::device::current_stream()), the engine's;
// the collectives run on the backend's communication stream, ordered by events, so gradient
// reductions overlap the rest of backward. The loss stays on the device and is read only when a
// progress line is printed.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "charlm_params.hpp"
#include "common.hpp"
#include "zp/backend/cuda_threads.cuh"
#include "zp/device.cuh"
#include "zp/engine.hpp"
#include "zp/schedule.hpp"
#if ZP_DEMO_NCCL
#include "zp/backend/mpi.hpp"
#include "zp/backend/nccl.hpp"
#endif

namespace examples {
// The mean of x over a device backend's ranks (common.hpp's hook), through a device double.
template <class Comm>
double device_mean(Comm& comm, double x) {
  zp::Buffer<double, zp::MemorySpace::device> d(1);
  zp::Ops<zp::MemorySpace::device>::from_host(d.span(), std::span<const double>(&x, 1));
  comm.all_reduce(d.span(), zp::ReduceOp::avg);
  zp::Ops<zp::MemorySpace::device>::to_host(std::span<double>(&x, 1), std::span<const double>(d.span()));
  return x;
}
}  // namespace examples

namespace demo_gpu {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw zp::Error(zp::Errc::cuda, std::string(what) + ": " + cudaGetErrorString(e), int(e));
}
void blas_ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw zp::Error(zp::Errc::cuda, std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}
int blocks(std::size_t n) { return int(std::min<std::size_t>((n + 255) / 256, 65535)); }
cudaStream_t stream() { return zp::device::current_stream(); }

// ---- kernels ---------------------------------------------------------------------------------

template <class T>
__global__ void to_float_kernel(float* out, const T* in, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    out[i] = float(in[i]);
}
template <class T>
__global__ void add_into_kernel(T* g, const float* d, std::size_t n) {  // zp's rule: gradients accumulate
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    g[i] = T(float(g[i]) + d[i]);
}
template <class T>
__global__ void embed_kernel(float* h0, const T* emb, const int* ctx, int rows, int context, int embed) {
  const std::size_t n = std::size_t(rows) * context * embed;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t e = i % embed, bc = i / embed;  // bc = b * context + c
    h0[i] = float(emb[std::size_t(ctx[bc]) * embed + e]);
  }
}
// Embedding gradient: atomics (the demo's only non-deterministic sum).
__global__ void embed_grad_kernel(float* ge, const float* dh0, const int* ctx, int rows, int context, int embed) {
  const std::size_t n = std::size_t(rows) * context * embed;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t e = i % embed, bc = i / embed;
    atomicAdd(ge + std::size_t(ctx[bc]) * embed + e, dh0[i]);
  }
}
template <class T>
__global__ void bias_act_kernel(float* y, const T* b, int rows, int out, bool tanh_act) {
  const std::size_t n = std::size_t(rows) * out;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const float a = y[i] + float(b[i % out]);
    y[i] = tanh_act ? tanhf(a) : a;
  }
}
__global__ void tanh_grad_kernel(float* dy, const float* y, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    dy[i] *= 1.0f - y[i] * y[i];
}
// gb[o] = sum over rows of dy[row][o] (one thread per column: deterministic).
__global__ void column_sum_kernel(float* gb, const float* dy, int rows, int out) {
  for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < out; o += gridDim.x * blockDim.x) {
    float s = 0;
    for (int r = 0; r < rows; ++r) s += dy[std::size_t(r) * out + o];
    gb[o] = s;
  }
}
// Softmax cross-entropy, one thread per row: dz = (p - onehot) * scale / rows; adds the mean loss
// of the micro-batch into *loss_sum.
__global__ void xent_kernel(float* dz, const float* z, const int* target, int rows, int vocab, float scale,
                            double* loss_sum) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    const float* zr = z + std::size_t(r) * vocab;
    float mx = zr[0];
    for (int c = 1; c < vocab; ++c) mx = fmaxf(mx, zr[c]);
    double se = 0;
    for (int c = 0; c < vocab; ++c) se += exp(double(zr[c] - mx));
    const int t = target[r];
    atomicAdd(loss_sum, (log(se) + mx - zr[t]) / rows);
    for (int c = 0; c < vocab; ++c)
      dz[std::size_t(r) * vocab + c] = (float(exp(double(zr[c] - mx)) / se) - (c == t ? 1.0f : 0.0f)) * scale / float(rows);
  }
}

// ---- the model (zp_demo's CharLm, on the device) --------------------------------------------

using examples::Dims;

template <class T>
struct CharLmGpu : examples::CharLmParams<T> {
  using Base = examples::CharLmParams<T>;
  using Base::d, Base::emb, Base::layer, typename Base::Dense;
  int rows = 0;
  // Device scratch (this rank's micro-batch): token ids, activations and their gradients.
  zp::Buffer<int, zp::MemorySpace::device> ctx, target;
  zp::Buffer<float, zp::MemorySpace::device> h[4], dh[4], wf, gw;
  zp::Buffer<double, zp::MemorySpace::device> loss_sum;
  cublasHandle_t blas = nullptr;

  CharLmGpu(Dims dims, int micro_batch, std::uint64_t seed = 1) : Base(dims, seed), rows(micro_batch) {
    std::size_t most = emb.size();
    for (const Dense& L : layer) most = std::max(most, L.w.size());
    ctx = zp::Buffer<int, zp::MemorySpace::device>(std::size_t(rows) * d.context);
    target = zp::Buffer<int, zp::MemorySpace::device>(std::size_t(rows));
    const std::size_t widths[4] = {std::size_t(d.context) * d.embed, std::size_t(d.hidden), std::size_t(d.hidden),
                                   std::size_t(d.vocab)};
    for (int k = 0; k < 4; ++k) {
      h[k] = zp::Buffer<float, zp::MemorySpace::device>(std::size_t(rows) * widths[k]);
      dh[k] = zp::Buffer<float, zp::MemorySpace::device>(std::size_t(rows) * widths[k]);
    }
    wf = zp::Buffer<float, zp::MemorySpace::device>(most);
    gw = zp::Buffer<float, zp::MemorySpace::device>(most);
    loss_sum = zp::Buffer<double, zp::MemorySpace::device>(1);
    zp::Ops<zp::MemorySpace::device>::zero(loss_sum.span());
    blas_ok(cublasCreate(&blas), "cublasCreate");
    blas_ok(cublasSetStream(blas, stream()), "cublasSetStream");
  }
  ~CharLmGpu() {
    if (blas) cublasDestroy(blas);
  }

  void load(const std::vector<int>& c, const std::vector<int>& t) {
    zp::Ops<zp::MemorySpace::device>::from_host(ctx.span(), std::span<const int>(c));
    zp::Ops<zp::MemorySpace::device>::from_host(target.span(), std::span<const int>(t));
  }

  // Row-major y[rows, out] = x[rows, in] w[out, in]^T. cuBLAS is column-major: the row-major
  // w is a column-major [in, out] matrix, x an [in, rows] one and y an [out, rows] one, so
  // y = w^T x is Sgemm(T, N, out, rows, in).
  void forward(int m) {
    const cudaStream_t s = stream();
    if (m == 0) {
      const std::size_t n = std::size_t(rows) * d.context * d.embed;
      embed_kernel<<<blocks(n), 256, 0, s>>>(h[0].data(), emb.value.data(), ctx.data(), rows, d.context, d.embed);
      cuda_ok(cudaGetLastError(), "embed_kernel");
      return;
    }
    Dense& L = layer[m - 1];
    to_float_kernel<<<blocks(L.w.size()), 256, 0, s>>>(wf.data(), L.w.value.data(), L.w.size());
    const float one = 1.0f, zero = 0.0f;
    blas_ok(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, L.out, rows, L.in, &one, wf.data(), L.in, h[m - 1].data(), L.in,
                        &zero, h[m].data(), L.out),
            "cublasSgemm (forward)");
    bias_act_kernel<<<blocks(std::size_t(rows) * L.out), 256, 0, s>>>(h[m].data(), L.b.value.data(), rows, L.out, m < 3);
    cuda_ok(cudaGetLastError(), "forward kernels");
  }

  void loss(float scale) {
    xent_kernel<<<blocks(std::size_t(rows)), 256, 0, stream()>>>(dh[3].data(), h[3].data(), target.data(), rows, d.vocab,
                                                                scale, loss_sum.data());
    cuda_ok(cudaGetLastError(), "xent_kernel");
  }
  // The sum of the micro-batch mean losses since the last call (reads the device: a sync).
  double take_loss() {
    double v = 0;
    zp::Ops<zp::MemorySpace::device>::to_host(std::span<double>(&v, 1), std::span<const double>(loss_sum.span()));
    zp::Ops<zp::MemorySpace::device>::zero(loss_sum.span());
    return v;
  }

  void backward(int m) {
    const cudaStream_t s = stream();
    if (m == 0) {
      const std::size_t n = std::size_t(rows) * d.context * d.embed;
      zp::Ops<zp::MemorySpace::device>::zero(gw.span(0, emb.size()));
      embed_grad_kernel<<<blocks(n), 256, 0, s>>>(gw.data(), dh[0].data(), ctx.data(), rows, d.context, d.embed);
      add_into_kernel<<<blocks(emb.size()), 256, 0, s>>>(emb.grad.data(), gw.data(), emb.size());
      cuda_ok(cudaGetLastError(), "embedding backward");
      return;
    }
    Dense& L = layer[m - 1];
    if (m < 3) tanh_grad_kernel<<<blocks(std::size_t(rows) * L.out), 256, 0, s>>>(dh[m].data(), h[m].data(), std::size_t(rows) * L.out);
    const float one = 1.0f, zero = 0.0f;
    // gW (row-major [out, in]) = dy^T x: column-major [in, out] = x^T(in x rows) dy(rows x out).
    blas_ok(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, L.in, L.out, rows, &one, h[m - 1].data(), L.in, dh[m].data(),
                        L.out, &zero, gw.data(), L.in),
            "cublasSgemm (weight gradient)");
    add_into_kernel<<<blocks(L.w.size()), 256, 0, s>>>(L.w.grad.data(), gw.data(), L.w.size());
    column_sum_kernel<<<blocks(std::size_t(L.out)), 256, 0, s>>>(gw.data(), dh[m].data(), rows, L.out);
    add_into_kernel<<<blocks(L.b.size()), 256, 0, s>>>(L.b.grad.data(), gw.data(), L.b.size());
    // dx (row-major [rows, in]) = dy w: column-major [in, rows] = w(in x out) dy^T(out x rows).
    to_float_kernel<<<blocks(L.w.size()), 256, 0, s>>>(wf.data(), L.w.value.data(), L.w.size());
    blas_ok(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, L.in, rows, L.out, &one, wf.data(), L.in, dh[m].data(), L.out,
                        &zero, dh[m - 1].data(), L.in),
            "cublasSgemm (input gradient)");
    cuda_ok(cudaGetLastError(), "backward kernels");
  }
};

// ---- command line and training ----------------------------------------------------------------

struct Options : examples::TrainFlags {
  int embed = 24, context = 16, hidden = 256;
  Options() { backend = "cuda_threads"; }
};

const char* usage =
    "usage: zp_demo_gpu [options]\n"
    "  --backend B        cuda_threads (N ranks on one GPU) or nccl (under mpirun, one process per GPU)\n"
    "  --ranks N          ranks for cuda_threads (default 4)\n"
    "  --stage S          ZeRO stage 0, 1, 2 or 3 (default 3)\n"
    "  --precision P      fp32 or bf16 (default bf16)\n"
    "  --offload cpu|none ZeRO-Offload: fp32 master weights and optimizer state in host memory (default none)\n"
    "  --accum N          gradient accumulation steps (default 1)\n"
    "  --steps N          optimizer steps (default 600)\n"
    "  --micro-batch N    sequences per rank per micro-step (default 32)\n"
    "  --lr X             peak learning rate of AdamW, warmup + cosine (default 3e-3)\n"
    "  --log-every N      progress line every N steps (default 50)\n"
    "  --text PATH        training text, repeatable (default: /usr/share/common-licenses/*)\n"
    "  --embed N --context N --hidden N   model sizes (default 24, 16, 256)\n"
    "  --help             this text\n";
const examples::Program program{"zp_demo_gpu", usage};

Options parse(int argc, char** argv) {
  Options o;
  examples::parse_args(program, argc, argv, [&](const std::string& a, const std::string& v) {
    if (a == "--backend") {
      if (v != "cuda_threads" && v != "nccl") examples::bad(program, "--backend expects cuda_threads or nccl, got '" + v + "'");
      o.backend = v;
    } else if (examples::parse_train_flag(program, o, a, v)) {
      if (o.precision == "fp16") examples::bad(program, "--precision fp16 is not offered by the GPU demo; use fp32 or bf16");
    } else if (a == "--embed") o.embed = examples::to_int(program, a, v, 1, 65536);
    else if (a == "--context") o.context = examples::to_int(program, a, v, 1, 65536);
    else if (a == "--hidden") o.hidden = examples::to_int(program, a, v, 1, 1 << 20);
    else return false;
    return true;
  });
  examples::default_text(program, o.text);
  return o;
}

template <class E, class B>
void train(zp::Collective<B>& comm, const Options& o, const examples::Corpus& corpus) {
  using T = typename E::value_type;
  const int n = comm.size(), r = comm.rank();
  const Dims dims{int(corpus.chars.size()), o.embed, o.context, o.hidden};
  CharLmGpu<T> model(dims, o.micro_batch);
  zp::EngineConfig ec;
  ec.batch = {.micro_batch_per_rank = o.micro_batch, .gradient_accumulation_steps = o.accum};
  ec.max_grad_norm = 1.0f;
  ec.offload_optimizer = o.offload;
  E engine(comm, model, ec, zp::optim::AdamW{.lr = o.lr});
  const zp::schedule::Any schedule =
      zp::schedule::WarmupCosineLR{.base_lr = o.lr, .total_num_steps = o.steps, .warmup_num_steps = std::max(1, o.steps / 20),
                                   .cos_min_ratio = 0.1, .warmup_type = zp::schedule::Warmup::linear};
  if (r == 0)
    std::printf("zp_demo_gpu: char-level LM on %zu characters (vocabulary %d), %zu parameters; ZeRO stage %d, backend %s, "
                "%d ranks, %s%s\n",
                corpus.ids.size(), dims.vocab, engine.layout().used(), E::stage, B::name, n, zp::name(zp::dtype_of<T>),
                o.offload ? ", optimizer offloaded to the CPU" : "");
  const std::size_t last_start = corpus.ids.size() - std::size_t(dims.context) - 1;
  std::uniform_int_distribution<std::size_t> pick(0, last_start);
  std::vector<int> c(std::size_t(o.micro_batch) * dims.context), t(std::size_t(o.micro_batch));
  const auto t0 = std::chrono::steady_clock::now();
  examples::Progress progress(o.log_every, 0, o.steps);
  for (int step = 0; step < o.steps; ++step) {
    engine.optimizer().lr = float(zp::schedule::lr(schedule, engine.steps()));
    zp::StepResult res;
    for (int a = 0; a < o.accum; ++a) {
      std::mt19937_64 rng((std::uint64_t(step) * 1024 + std::uint64_t(a)) * 1000003ull + std::uint64_t(r) * 7919 + 17);
      for (int b = 0; b < o.micro_batch; ++b) {
        const std::size_t s = pick(rng);
        for (int k = 0; k < dims.context; ++k) c[std::size_t(b * dims.context + k)] = corpus.ids[s + std::size_t(k)];
        t[std::size_t(b)] = corpus.ids[s + std::size_t(dims.context)];
      }
      model.load(c, t);
      for (int m = 0; m < model.modules; ++m) {
        auto g = engine.forward(m);
        model.forward(m);
      }
      model.loss(engine.loss_scale());
      for (int m = model.modules - 1; m >= 0; --m) {
        auto g = engine.backward(m);
        model.backward(m);
      }
      res = engine.step();
    }
    // The loss sum since the last line, read from the device only when a line is printed.
    const double loss = progress.logs(step) ? model.take_loss() / o.accum : 0.0;
    progress.step(comm, engine, step, loss, res, std::int64_t(o.micro_batch) * o.accum * n);
  }
  cuda_ok(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (r == 0) {
    std::printf("\nsummary: loss %.4f -> %.4f in %d steps (%lld updates), %.1f s, %.0f tokens/s\n", progress.first_loss(),
                progress.last_loss(), o.steps, static_cast<long long>(engine.steps()), secs,
                double(o.steps) * o.micro_batch * o.accum * n / secs);
    examples::print_memory(engine.memory());
  }
}

template <class B>
void dispatch(zp::Collective<B>& comm, const Options& o, const examples::Corpus& corpus) {
  auto with = [&]<class T>() {
    switch (o.stage) {
      case 0: return train<zp::Engine<B, T, 0>>(comm, o, corpus);
      case 1: return train<zp::Engine<B, T, 1>>(comm, o, corpus);
      case 2: return train<zp::Engine<B, T, 2>>(comm, o, corpus);
      default: return train<zp::Engine<B, T, 3>>(comm, o, corpus);
    }
  };
  if (o.precision == "fp32") with.template operator()<float>();
  else with.template operator()<zp::bf16>();
}

}  // namespace demo_gpu

using namespace demo_gpu;

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const examples::Corpus corpus = examples::load_corpus_or_exit(program, o.text, std::size_t(o.context) + 100);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "zp_demo_gpu: no CUDA device available\n");
    return 2;
  }
  try {
    if (o.backend == "nccl") {
#if ZP_DEMO_NCCL
      zp::backend::MpiEnvironment env(&argc, &argv);
      zp::Collective<zp::backend::Nccl> comm(zp::backend::nccl_from_mpi(MPI_COMM_WORLD));  // sets the device
      zp::device::Stream compute;  // the model's and the engine's; nccl communicates on its own
      zp::device::StreamScope on(compute.get());
      dispatch(comm, o, corpus);
#else
      examples::bad(program, "this zp_demo_gpu was built without NCCL and MPI");
#endif
    } else {
      zp::backend::run_cuda_threads(o.ranks, [&](zp::Collective<zp::backend::CudaThreads>& comm) { dispatch(comm, o, corpus); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zp_demo_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
