// zp_demo_gpu / zp_demo_sim: zp_demo's character-level language model on a device: the same
// model, parameter names, data and progress line, with its forward and backward written once on
// zp's device primitives (element functions run by zp::device::launch, zp::device::gemm for the
// matrix products) and trained by the same engine on device memory. Built with nvcc
// (charlm_device.cu) it is zp_demo_gpu and runs on a GPU (cuBLAS); built with any C++ compiler
// against zp::sim it is zp_demo_sim and runs on the simulated device.
//
//   zp_demo_gpu [--backend cuda_threads|nccl] [--ranks N] [--stage 0-3] [--precision fp32|bf16]
//               [--offload-optimizer none|cpu|nvme:DIR] [--offload-param none|cpu|nvme:DIR]
//               [--accum N] [--steps N] [--micro-batch N] [--lr X]
//               [--init-seed N] [--log-every N] [--text PATH]... [--embed N] [--context N]
//               [--hidden N] [--checkpoint-dir DIR] [--save-every N] [--keep-checkpoints N]
//               [--resume] [--export DIR] [--wall-clock-breakdown] [--log-json PATH]
//               [--config ds_config.json] [--zero-quantized-weights]
//               [--zero-hpz-partition-size N] [--zero-quantized-gradients] [--ranks-per-node N]
//
// --backend cuda_threads (default): N ranks as threads on one device (zp/backend/cuda_threads.hpp).
// --backend nccl: one process per GPU under mpirun (zp::backend::nccl_from_mpi; zp_demo_gpu only).
// Sizes are flags so the model can fill a GPU (e.g. --hidden 8192 --micro-batch 1024).
// Every launch runs on the rank's compute stream (zp::device::current_stream()), the engine's;
// the collectives run on the backend's communication stream, ordered by events, so gradient
// reductions overlap the rest of backward. The loss stays on the device and is read only when a
// progress line is printed (and each step with --log-json). Every sum is in a fixed order, so a
// run on a given GPU repeats bit for bit. Its run flags, engine settings, checkpoints and exports
// are zp_demo's (examples/run_control.hpp): a run saved here resumes in zp_demo and the reverse,
// at any --ranks and --stage.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "charlm_params.hpp"
#include "common.hpp"
#include "run_control.hpp"
#include "zp/backend/cuda_threads.hpp"
#include "zp/device/gemm.hpp"
#include "zp/device/memory.hpp"
#include "zp/engine.hpp"
#include "zp/schedule.hpp"
#if ZP_DEMO_NCCL
#include "zp/backend/mpi.hpp"
#include "zp/backend/nccl.hpp"
#endif

#if defined(ZP_DEVICE_SIM)
#define ZP_DEMO_NAME "zp_demo_sim"
#else
#define ZP_DEMO_NAME "zp_demo_gpu"
#endif

namespace examples {
// all_reduce of host values over a device backend's ranks (common.hpp's hook), through a device
// buffer.
template <class Comm, class X>
void device_all_reduce(Comm& comm, std::span<X> x, zp::ReduceOp op) {
  zp::Buffer<X, zp::MemorySpace::device> d(x.size());
  zp::Memory<zp::MemorySpace::device>::from_host(d.span(), std::span<const X>(x));
  comm.all_reduce(d.span(), op);
  zp::Memory<zp::MemorySpace::device>::to_host(x, std::span<const X>(d.span()));
}
}  // namespace examples

namespace demo_device {

using Dev = zp::Memory<zp::MemorySpace::device>;
template <class X>
using DevBuf = zp::Buffer<X, zp::MemorySpace::device>;
zp::device::stream_t stream() { return zp::device::current_stream(); }

// ---- element functions (one work item each) -------------------------------------------------

template <class T>
struct Embed {  // h0[b, c, e] = emb[ctx[b, c], e]
  float* h0;
  const T* emb;
  const int* ctx;
  int embed;
  ZP_HOST_DEVICE void operator()(std::size_t i) const {
    const std::size_t e = i % std::size_t(embed), bc = i / std::size_t(embed);
    h0[i] = float(emb[std::size_t(ctx[bc]) * std::size_t(embed) + e]);
  }
};
struct EmbedGrad {  // column e of the embedding gradient, over every position in order
  float* ge;
  const float* dh0;
  const int* ctx;
  std::size_t positions;
  int embed;
  ZP_HOST_DEVICE void operator()(std::size_t e) const {
    for (std::size_t bc = 0; bc < positions; ++bc)
      ge[std::size_t(ctx[bc]) * std::size_t(embed) + e] += dh0[bc * std::size_t(embed) + e];
  }
};
template <class T>
struct BiasAct {  // y = act(y + b), b broadcast over rows
  float* y;
  const T* b;
  int out;
  bool tanh_act;
  ZP_HOST_DEVICE void operator()(std::size_t i) const {
    const float a = y[i] + float(b[i % std::size_t(out)]);
    y[i] = tanh_act ? ::tanhf(a) : a;
  }
};
struct TanhGrad {
  float* dy;
  const float* y;
  ZP_HOST_DEVICE void operator()(std::size_t i) const { dy[i] *= 1.0f - y[i] * y[i]; }
};
struct ColumnSum {  // gb[o] = sum over rows of dy[row, o]
  float* gb;
  const float* dy;
  int rows, out;
  ZP_HOST_DEVICE void operator()(std::size_t o) const {
    float s = 0;
    for (int r = 0; r < rows; ++r) s += dy[std::size_t(r) * std::size_t(out) + o];
    gb[o] = s;
  }
};
// Softmax cross-entropy of row r: dz = (p - onehot) * scale / rows, and the row's loss / rows.
struct Xent {
  float* dz;
  double* row_loss;
  const float* z;
  const int* target;
  int rows, vocab;
  float scale;
  ZP_HOST_DEVICE void operator()(std::size_t r) const {
    const float* zr = z + r * std::size_t(vocab);
    float mx = zr[0];
    for (int c = 1; c < vocab; ++c) mx = ::fmaxf(mx, zr[c]);
    double se = 0;
    for (int c = 0; c < vocab; ++c) se += ::exp(double(zr[c] - mx));
    const int t = target[r];
    row_loss[r] = (::log(se) + mx - zr[t]) / rows;
    for (int c = 0; c < vocab; ++c)
      dz[r * std::size_t(vocab) + std::size_t(c)] =
          (float(::exp(double(zr[c] - mx)) / se) - (c == t ? 1.0f : 0.0f)) * scale / float(rows);
  }
};
struct Value {  // x[i] as a summand
  const double* x;
  ZP_HOST_DEVICE double operator()(std::size_t i) const { return x[i]; }
};

// ---- the model (zp_demo's CharLm, on the device) --------------------------------------------

using examples::Dims;

template <class T>
struct CharLmDevice : examples::CharLmParams<T> {
  using Base = examples::CharLmParams<T>;
  using Base::d, Base::emb, Base::layer, typename Base::Dense;
  int rows = 0;
  // Device scratch (this rank's micro-batch): token ids, activations and their gradients.
  DevBuf<int> ctx, target;
  DevBuf<float> h[4], dh[4], wf, gw;
  DevBuf<double> row_loss, loss_sum;

  CharLmDevice(Dims dims, int micro_batch, std::uint64_t seed = 1)
      : Base(dims, seed), rows(micro_batch) {
    std::size_t most = emb.size();
    for (const Dense& L : layer) most = std::max(most, L.w.size());
    ctx = DevBuf<int>(std::size_t(rows) * d.context);
    target = DevBuf<int>(std::size_t(rows));
    const std::size_t widths[4] = {std::size_t(d.context) * d.embed, std::size_t(d.hidden),
                                   std::size_t(d.hidden), std::size_t(d.vocab)};
    for (int k = 0; k < 4; ++k) {
      h[k] = DevBuf<float>(std::size_t(rows) * widths[k]);
      dh[k] = DevBuf<float>(std::size_t(rows) * widths[k]);
    }
    wf = DevBuf<float>(most);
    gw = DevBuf<float>(most);
    row_loss = DevBuf<double>(std::size_t(rows));
    loss_sum = DevBuf<double>(1);
    Dev::zero(loss_sum.span());
  }

  void load(const std::vector<int>& c, const std::vector<int>& t) {
    Dev::from_host(ctx.span(), std::span<const int>(c));
    Dev::from_host(target.span(), std::span<const int>(t));
  }

  // Row-major y[rows, out] = x[rows, in] w[out, in]^T. In column-major terms the row-major w is
  // an [in, out] matrix, x an [in, rows] one and y an [out, rows] one, so y = w^T x.
  void forward(int m) {
    if (m == 0) {
      zp::device::launch(stream(), std::size_t(rows) * d.context * d.embed,
                         Embed<T>{h[0].data(), emb.value.data(), ctx.data(), d.embed});
      return;
    }
    Dense& L = layer[m - 1];
    Dev::convert(wf.span(0, L.w.size()), std::span<const T>(L.w.value.data(), L.w.size()));
    zp::device::gemm(stream(), true, false, L.out, rows, L.in, 1.0f, wf.data(), L.in,
                     h[m - 1].data(), L.in, 0.0f, h[m].data(), L.out);
    zp::device::launch(stream(), std::size_t(rows) * L.out,
                       BiasAct<T>{h[m].data(), L.b.value.data(), L.out, m < 3});
  }

  void loss(float scale) {
    zp::device::launch(
        stream(), std::size_t(rows),
        Xent{dh[3].data(), row_loss.data(), h[3].data(), target.data(), rows, d.vocab, scale});
    zp::device::sum(stream(), std::size_t(rows), Value{row_loss.data()}, loss_sum.data());
  }
  // The sum of the micro-batch mean losses since the last call (reads the device: a sync).
  double take_loss() {
    double v = 0;
    Dev::to_host(std::span<double>(&v, 1), std::span<const double>(loss_sum.span()));
    Dev::zero(loss_sum.span());
    return v;
  }

  // zp's rule: gradients accumulate into the parameters' grad (Memory::accumulate).
  void backward(int m) {
    if (m == 0) {
      Dev::zero(gw.span(0, emb.size()));
      zp::device::launch(
          stream(), std::size_t(d.embed),
          EmbedGrad{gw.data(), dh[0].data(), ctx.data(), std::size_t(rows) * d.context, d.embed});
      Dev::accumulate(std::span<T>(emb.grad.data(), emb.size()),
                      std::span<const float>(gw.span(0, emb.size())));
      return;
    }
    Dense& L = layer[m - 1];
    if (m < 3)
      zp::device::launch(stream(), std::size_t(rows) * L.out, TanhGrad{dh[m].data(), h[m].data()});
    // gW (row-major [out, in]) = dy^T x: column-major [in, out] = x^T(in x rows) dy(rows x out).
    zp::device::gemm(stream(), false, true, L.in, L.out, rows, 1.0f, h[m - 1].data(), L.in,
                     dh[m].data(), L.out, 0.0f, gw.data(), L.in);
    Dev::accumulate(std::span<T>(L.w.grad.data(), L.w.size()),
                    std::span<const float>(gw.span(0, L.w.size())));
    zp::device::launch(stream(), std::size_t(L.out),
                       ColumnSum{gw.data(), dh[m].data(), rows, L.out});
    Dev::accumulate(std::span<T>(L.b.grad.data(), L.b.size()),
                    std::span<const float>(gw.span(0, L.b.size())));
    // dx (row-major [rows, in]) = dy w: column-major [in, rows] = w(in x out) dy^T(out x rows).
    Dev::convert(wf.span(0, L.w.size()), std::span<const T>(L.w.value.data(), L.w.size()));
    zp::device::gemm(stream(), false, false, L.in, rows, L.out, 1.0f, wf.data(), L.in, dh[m].data(),
                     L.out, 0.0f, dh[m - 1].data(), L.in);
  }
};

// ---- command line and training ----------------------------------------------------------------

struct Options : examples::TrainFlags, examples::RunFlags {
  int embed = 24, context = 16, hidden = 256;
  Options() { backend = "cuda_threads"; }
};

const char* usage =
    "usage: " ZP_DEMO_NAME
    " [options]\n"
    "  --backend B        cuda_threads (N ranks on one device) or nccl (zp_demo_gpu under mpirun, "
    "one process per GPU)\n"
    "  --ranks N          ranks for cuda_threads (default 4)\n"
    "  --stage S          ZeRO stage 0, 1, 2 or 3 (default 3)\n"
    "  --precision P      fp32 or bf16 (default bf16)\n"
    "  --offload-optimizer none|cpu|nvme:DIR\n"
    "                     fp32 master weights and optimizer state in host memory (ZeRO-Offload)\n"
    "                     or in a swap file under DIR (ZeRO-Infinity) (default none)\n"
    "  --offload-param none|cpu|nvme:DIR\n"
    "                     stage 3: each rank's 16-bit parameter shard in page-locked host memory\n"
    "                     or in a swap file under DIR (nvme needs --offload-optimizer) (default "
    "none)\n"
    "  --accum N          gradient accumulation steps (default 1)\n"
    "  --steps N          optimizer steps (default 600)\n"
    "  --micro-batch N    sequences per rank per micro-step (default 32)\n"
    "  --lr X             peak learning rate of AdamW, warmup + cosine (default 3e-3)\n"
    "  --init-seed N      the initial weights' random seed (default 1)\n"
    "  --log-every N      progress line every N steps (default 50)\n"
    "  --text PATH        training text, repeatable (default: /usr/share/common-licenses/*)\n"
    "  --embed N --context N --hidden N   model sizes (default 24, 16, 256)\n";
const examples::Program program{ZP_DEMO_NAME, usage, examples::run_usage};

Options parse(int argc, char** argv) {
  Options o;
  const auto flag = [&](const std::string& a, const std::string& v) {
    if (a == "--backend") {
      if (v != "cuda_threads" && v != "nccl")
        examples::bad(program, "--backend expects cuda_threads or nccl, got '" + v + "'");
      o.backend = v;
    } else if (examples::parse_train_flag(program, o, a, v)) {
      if (o.precision == "fp16")
        examples::bad(program,
                      "--precision fp16 is not offered by the device demo; use fp32 or bf16");
    } else if (a == "--embed")
      o.embed = examples::to_int(program, a, v, 1, 65536);
    else if (a == "--context")
      o.context = examples::to_int(program, a, v, 1, 65536);
    else if (a == "--hidden")
      o.hidden = examples::to_int(program, a, v, 1, 1 << 20);
    else
      return examples::parse_run_flag(program, o, a, v);
    return true;
  };
  o.given = examples::parse_args(program, argc, argv, flag, examples::run_switches);
  examples::check_run_flags(program, o, o.given);
  examples::default_text(program, o.text);
  return o;
}

// cuBLAS takes int dimensions, and the first layer's input and a batch's positions are counted in
// int (the micro-batch: the flag's or the config's).
void check_sizes(const Options& o, int micro_batch) {
  const std::pair<const char*, std::int64_t> sizes[] = {
      {"--context x --embed", std::int64_t(o.context) * o.embed},
      {"the micro-batch x --context", std::int64_t(micro_batch) * o.context}};
  for (const auto& [what, n] : sizes)
    ZP_EXPECT(n <= std::numeric_limits<int>::max(), ZP_DEMO_NAME ": ", what, " is ", n,
              ", more than ", std::numeric_limits<int>::max());
}

// E: the zp::Engine type (backend, element type, stage), chosen by the flags or by
// zp::ds::with_engine from a config.
template <class E, class B>
void train(zp::Collective<B>& comm, const Options& o, const examples::Corpus& corpus,
           const zp::EngineConfig& cfg, const zp::optim::AdamW& opt,
           const zp::schedule::Any& schedule) {
  using T = typename E::value_type;
  const int n = comm.size(), r = comm.rank();
  const int micro_batch = int(cfg.batch.micro_batch_per_rank),
            accum = int(cfg.batch.gradient_accumulation_steps);
  check_sizes(o, micro_batch);
  const Dims dims{int(corpus.chars.size()), o.embed, o.context, o.hidden};
  CharLmDevice<T> model(dims, micro_batch, o.init_seed);
  E engine(comm, model, cfg, opt);
  if (r == 0)
    std::printf(ZP_DEMO_NAME
                ": char-level LM on %zu characters (vocabulary %d), %zu parameters; ZeRO stage %d, "
                "backend %s, %d ranks, %s, micro-batch %d x accumulation %d%s%s\n",
                corpus.ids.size(), dims.vocab, engine.layout().used(), E::stage, B::name, n,
                zp::name(zp::dtype_of<T>), micro_batch, accum,
                cfg.optimizer_nvme      ? ", optimizer state on NVMe, stepped by the CPU"
                : cfg.offload_optimizer ? ", optimizer offloaded to the CPU"
                                        : "",
                cfg.param_nvme      ? ", parameters on NVMe"
                : cfg.offload_param ? ", parameters offloaded"
                                    : "");
  const std::size_t last_start = corpus.ids.size() - std::size_t(dims.context) - 1;
  std::uniform_int_distribution<std::size_t> pick(0, last_start);
  std::vector<int> c(static_cast<std::size_t>(micro_batch) * std::size_t(dims.context)),
      t(static_cast<std::size_t>(micro_batch));
  const bool lead = r == 0;
  const int first_step = examples::resume(engine, comm, program, o, corpus, o.steps);
  examples::JsonLog json(o, lead);
  zp::StepTimes sum;  // over the steps after the first (which pays for first touches)
  const auto t0 = std::chrono::steady_clock::now();
  examples::Progress progress(o.log_every, first_step, o.steps);
  examples::stop_signal::install();
  int done = first_step;  // steps done: o.steps, or fewer where a signal stopped the run
  bool stopped = false;
  for (int step = first_step; step < o.steps && !stopped; ++step) {
    engine.optimizer().lr = float(zp::schedule::lr(schedule, engine.steps()));
    zp::StepResult res;
    for (int a = 0; a < accum; ++a) {
      // A micro-batch's samples depend only on (rank, step, micro-step), as zp_demo's.
      std::mt19937_64 rng((std::uint64_t(step) * 1024 + std::uint64_t(a)) * 1000003ull +
                          std::uint64_t(r) * 7919 + 17);
      for (int b = 0; b < micro_batch; ++b) {
        const std::size_t s = pick(rng);
        for (int k = 0; k < dims.context; ++k)
          c[std::size_t(b * dims.context + k)] = corpus.ids[s + std::size_t(k)];
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
    if (step > first_step) sum += res.times;
    // The loss sum since it was last read, read from the device only for a progress line or
    // (--log-json) every step.
    const bool read = progress.logs(step) || !o.log_json.empty();
    const double loss = read ? model.take_loss() / accum : 0.0;
    if (!o.log_json.empty()) json.line(step + 1, examples::mean_over_ranks(comm, loss), res);
    progress.step(comm, engine, step, loss, res, std::int64_t(micro_batch) * accum * n);
    done = step + 1;
    stopped = examples::end_step(engine, comm, program, o, done, corpus, lead);
  }
  if (!stopped) examples::export_model(engine, o, corpus, lead);
  zp::device::synchronize(stream(), "demo end");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (lead && first_step < done) {  // a checkpoint at or past --steps: nothing trained
    std::printf("\nsummary: loss %.4f -> %.4f in %d steps (%lld updates), %.1f s, %.0f tokens/s\n",
                progress.first_loss(), progress.last_loss(), done - first_step,
                static_cast<long long>(engine.steps()), secs,
                double(done - first_step) * micro_batch * accum * n / secs);
    examples::print_memory(engine.memory());
    examples::print_step_times(sum, done - first_step - 1);
  }
}

template <class B>
void dispatch(zp::Collective<B>& comm, const Options& o, const examples::Corpus& corpus) {
  // fp16 (refused by the flags, an error from a config) is not compiled in: the device demo's
  // engines are those of fp32 and bf16.
  // A model sized to fill a GPU: the engine's buckets.
  examples::with_engine<B, zp::Types<float, zp::bf16>>(
      program, o, o, comm.size(), comm.rank() == 0, std::uint64_t(o.hidden), zp::EngineConfig{},
      [&]<class E>(std::type_identity<E>, const zp::EngineConfig& ec, const zp::optim::AdamW& opt,
                   const zp::schedule::Any& sched) { train<E>(comm, o, corpus, ec, opt, sched); });
}

}  // namespace demo_device

using namespace demo_device;

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const examples::Corpus corpus =
      examples::load_corpus_or_exit(program, o.text, std::size_t(o.context) + 100);
  if (zp::device::device_count() == 0) {
    std::fprintf(stderr, ZP_DEMO_NAME ": no CUDA device available\n");
    return 2;
  }
  try {
    if (o.backend == "nccl") {
#if ZP_DEMO_NCCL
      zp::backend::MpiEnvironment env(&argc, &argv);
      int processes = 0, rank = 0;
      MPI_Comm_size(MPI_COMM_WORLD, &processes);
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (!examples::ranks_match_job(ZP_DEMO_NAME, o, "nccl", processes, rank)) return 2;
      zp::Collective<zp::backend::Nccl> comm(
          zp::backend::nccl_from_mpi(MPI_COMM_WORLD));  // sets the device
      zp::device::Stream compute;  // the model's and the engine's; nccl communicates on its own
      zp::device::StreamScope on(compute.get());
      dispatch(comm, o, corpus);
#else
      examples::bad(program, "this " ZP_DEMO_NAME " was built without NCCL and MPI");
#endif
    } else {
      zp::backend::run_cuda_threads(o.ranks, [&](zp::Collective<zp::backend::CudaThreads>& comm) {
        dispatch(comm, o, corpus);
      });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, ZP_DEMO_NAME ": %s\n", e.what());
    return 1;
  }
  return examples::stop_signal::exit_status();
}
