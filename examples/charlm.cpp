// zp_demo: a character-level language model with hand-written forward and backward, trained
// with ZeRO data parallelism on the licence texts every Debian machine has.
//
// The model predicts the next character from the previous `context` characters: an embedding
// (module 0), two tanh layers (modules 1 and 2) and a softmax output layer (module 3). It knows
// nothing of zp except for_each_parameter; the training loop wraps each module's forward and
// backward in the engine's guards, which is all stage 3 needs to gather, prefetch and release.
//
//   zp_demo [--stage 0-3] [--backend threads|mpi] [--ranks N] [--precision fp32|bf16|fp16]
//           [--accum N] [--steps N] [--micro-batch N] [--lr X] [--init-seed N] [--log-every N]
//           [--text PATH]...
//           [--checkpoint-dir DIR] [--save-every N] [--resume] [--export DIR]
//           [--wall-clock-breakdown] [--log-json PATH] [--config ds_config.json]
//
// A run saved with --checkpoint-dir/--save-every can be killed at any moment (kill -9) and goes
// on with --resume from the last complete checkpoint, at any --ranks, --stage or --backend.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "charlm_params.hpp"
#include "common.hpp"
#include "run_control.hpp"
#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/schedule.hpp"

namespace {

// ---- the model ------------------------------------------------------------------------------

using examples::Dims;

// y[b][o] = sum_i w[o][i] x[b][i] + bias[o]; eight partial sums so the compiler vectorises it.
inline float dot(const float* a, const float* b, int n) {
  float s[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) t += a[i] * b[i];
  return t;
}

template <class T>
void to_float(std::vector<float>& out, const zp::View<T>& v) {
  out.resize(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = float(v[i]);
}
template <class T>
void add_into(zp::View<T>& g, const std::vector<float>& d) {
  for (std::size_t i = 0; i < d.size(); ++i) g[i] = T(float(g[i]) + d[i]);
}

template <class T>
struct CharLm : examples::CharLmParams<T> {
  using Base = examples::CharLmParams<T>;
  using Base::d, Base::emb, Base::layer, typename Base::Dense;
  // activations of the current micro-batch
  int batch = 0;
  std::vector<int> ctx, target;
  std::vector<float> h[4], dh[4], wf;  // h[0] = concatenated embeddings, h[3] = logits

  explicit CharLm(Dims dims, std::uint64_t seed = 1) : Base(dims, seed) {}

  void forward(int m) {
    if (m == 0) {
      const int w = d.context * d.embed;
      h[0].assign(std::size_t(batch * w), 0.0f);
      for (int b = 0; b < batch; ++b)
        for (int c = 0; c < d.context; ++c)
          for (int e = 0; e < d.embed; ++e)
            h[0][std::size_t(b * w + c * d.embed + e)] =
                float(emb.value[std::size_t(ctx[std::size_t(b * d.context + c)] * d.embed + e)]);
      return;
    }
    Dense& L = layer[m - 1];
    to_float(wf, L.w.value);
    const auto& x = h[m - 1];
    auto& y = h[m];
    y.assign(std::size_t(batch * L.out), 0.0f);
    for (int b = 0; b < batch; ++b)
      for (int o = 0; o < L.out; ++o) {
        const float a = dot(wf.data() + std::size_t(o) * std::size_t(L.in),
                            x.data() + std::size_t(b * L.in), L.in) +
                        float(L.b.value[std::size_t(o)]);
        y[std::size_t(b * L.out + o)] = m < 3 ? std::tanh(a) : a;
      }
  }

  // Mean cross-entropy of the micro-batch; seeds dh[3] with d(scale * loss)/d(logits).
  float loss(float scale) {
    const auto& z = h[3];
    auto& g = dh[3];
    g.assign(z.size(), 0.0f);
    double total = 0;
    for (int b = 0; b < batch; ++b) {
      const float* zb = z.data() + std::size_t(b * d.vocab);
      const float mx = *std::max_element(zb, zb + d.vocab);
      double se = 0;
      for (int c = 0; c < d.vocab; ++c) se += std::exp(double(zb[c] - mx));
      const int t = target[std::size_t(b)];
      total += std::log(se) + mx - zb[t];
      for (int c = 0; c < d.vocab; ++c) {
        const float p = float(std::exp(double(zb[c] - mx)) / se);
        g[std::size_t(b * d.vocab + c)] = (p - (c == t ? 1.0f : 0.0f)) * scale / float(batch);
      }
    }
    return float(total / batch);
  }

  void backward(int m) {
    if (m == 0) {
      std::vector<float> ge(emb.size(), 0.0f);
      const int w = d.context * d.embed;
      for (int b = 0; b < batch; ++b)
        for (int c = 0; c < d.context; ++c)
          for (int e = 0; e < d.embed; ++e)
            ge[std::size_t(ctx[std::size_t(b * d.context + c)] * d.embed + e)] +=
                dh[0][std::size_t(b * w + c * d.embed + e)];
      add_into(emb.grad, ge);
      return;
    }
    Dense& L = layer[m - 1];
    const auto& x = h[m - 1];
    auto& dy = dh[m];
    if (m < 3)  // through tanh: dy *= 1 - y^2
      for (std::size_t i = 0; i < dy.size(); ++i) dy[i] *= 1.0f - h[m][i] * h[m][i];
    std::vector<float> gw(L.w.size(), 0.0f), gb(L.b.size(), 0.0f);
    to_float(wf, L.w.value);
    auto& dx = dh[m - 1];
    dx.assign(std::size_t(batch * L.in), 0.0f);
    for (int b = 0; b < batch; ++b) {
      const float* xb = x.data() + std::size_t(b * L.in);
      float* dxb = dx.data() + std::size_t(b * L.in);
      for (int o = 0; o < L.out; ++o) {
        const float g = dy[std::size_t(b * L.out + o)];
        gb[std::size_t(o)] += g;
        float* gwo = gw.data() + std::size_t(o) * std::size_t(L.in);
        const float* wo = wf.data() + std::size_t(o) * std::size_t(L.in);
        for (int i = 0; i < L.in; ++i) {
          gwo[i] += g * xb[i];
          dxb[i] += g * wo[i];
        }
      }
    }
    add_into(L.w.grad, gw);
    add_into(L.b.grad, gb);
  }
};

using examples::Corpus;
using examples::load_corpus;

// ---- command line ---------------------------------------------------------------------------

struct Options : examples::TrainFlags, examples::RunFlags {};  // TrainFlags' defaults are ours

const char* usage =
    "usage: zp_demo [options]\n"
    "  --stage S          ZeRO stage 0, 1, 2 or 3 (default 3)\n"
    "  --backend B        threads or mpi (mpi: run under mpirun, one process per rank) (default "
    "threads)\n"
    "  --ranks N          thread ranks for the threads backend (default 4)\n"
    "  --precision P      fp32, bf16 or fp16 (fp16 uses dynamic loss scaling) (default bf16)\n"
    "  --accum N          gradient accumulation steps (default 1)\n"
    "  --steps N          optimizer steps (default 600)\n"
    "  --micro-batch N    sequences per rank per micro-step (default 32)\n"
    "  --lr X             peak learning rate of AdamW, warmup + cosine (default 3e-3)\n"
    "  --init-seed N      the initial weights' random seed (default 1)\n"
    "  --offload-optimizer none|cpu|nvme:DIR\n"
    "                     fp32 master weights and optimizer state in host memory (ZeRO-Offload)\n"
    "                     or in a swap file under DIR (ZeRO-Infinity) (default none)\n"
    "  --offload-param none|cpu|nvme:DIR\n"
    "                     stage 3: each rank's 16-bit parameter shard in host memory (where the\n"
    "                     host backends keep it) or in a swap file under DIR (default none)\n"
    "  --log-every N      progress line every N steps (default 50)\n"
    "  --text PATH        training text, repeatable (default: /usr/share/common-licenses/*)\n";

const examples::Program program{"zp_demo", usage, examples::run_usage};

Options parse(int argc, char** argv) {
  Options o;
  o.given = examples::parse_args(
      program, argc, argv,
      [&](const std::string& a, const std::string& v) {
        return examples::parse_train_flag(program, o, a, v) ||
               examples::parse_run_flag(program, o, a, v);
      },
      examples::run_switches);
  examples::check_run_flags(program, o, o.given);
  examples::default_text(program, o.text);
  return o;
}

// ---- training -------------------------------------------------------------------------------

// E: the zp::Engine type (backend, element type, stage, optimizer), chosen by the flags or by
// zp::ds::with_engine from a config.
template <class E, class B>
void train(zp::Collective<B>& comm, const Options& o, const Corpus& corpus,
           const zp::EngineConfig& cfg, typename E::optimizer_type opt,
           const zp::schedule::Any& schedule) {
  using T = typename E::value_type;
  constexpr int Stage = E::stage;
  const int n = comm.size(), r = comm.rank();
  const bool lead = r == 0;
  Dims dims;
  dims.vocab = int(corpus.chars.size());
  CharLm<T> model(dims, o.init_seed);
  E engine(comm, model, cfg, opt);
  const int micro_batch = int(engine.batch().micro_batch_per_rank),
            accum = int(engine.batch().gradient_accumulation_steps);

  const auto& L = engine.layout();
  if (lead) {
    std::printf(
        "zp_demo: char-level LM on %zu characters (vocabulary %d), %zu parameters in %d modules, "
        "%d buckets\n",
        corpus.ids.size(), dims.vocab, L.used(), L.module_count(), L.segment_count());
    std::printf(
        "         ZeRO stage %d, backend %s, %d ranks, %s, micro-batch %d x accumulation %d x "
        "ranks %d = %lld sequences/step\n",
        Stage, B::name, n, zp::name(zp::dtype_of<T>), micro_batch, accum, n,
        static_cast<long long>(engine.batch().train_batch_size));
  }
  // Each micro-batch's samples depend only on (rank, step, micro-step), so a resumed run needs
  // nothing but the step to continue the same data stream.
  const std::size_t last_start = corpus.ids.size() - std::size_t(dims.context) - 1;
  std::uniform_int_distribution<std::size_t> pick(0, last_start);
  auto next_batch = [&](std::int64_t step, int a) {
    std::mt19937_64 rng((std::uint64_t(step) * 1024 + std::uint64_t(a)) * 1000003ull +
                        std::uint64_t(r) * 7919 + 17);
    model.batch = micro_batch;
    model.ctx.resize(std::size_t(micro_batch * dims.context));
    model.target.resize(std::size_t(micro_batch));
    for (int b = 0; b < micro_batch; ++b) {
      const std::size_t s = pick(rng);
      for (int c = 0; c < dims.context; ++c)
        model.ctx[std::size_t(b * dims.context + c)] = corpus.ids[s + std::size_t(c)];
      model.target[std::size_t(b)] = corpus.ids[s + std::size_t(dims.context)];
    }
  };

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
    double loss = 0;
    zp::StepResult res;
    for (int a = 0; a < accum; ++a) {
      next_batch(step, a);
      for (int m = 0; m < model.modules; ++m) {
        auto g = engine.forward(m);
        model.forward(m);
      }
      loss += model.loss(engine.loss_scale()) / float(accum);
      for (int m = model.modules - 1; m >= 0; --m) {
        auto g = engine.backward(m);
        model.backward(m);
      }
      res = engine.step();
    }
    if (step > first_step) sum += res.times;
    // The log's loss is the global batch's, as the progress line's (same flags on every rank).
    if (!o.log_json.empty()) json.line(step + 1, examples::mean_over_ranks(comm, loss), res);
    progress.step(comm, engine, step, loss, res, std::int64_t(micro_batch) * accum * n);
    done = step + 1;
    stopped = examples::end_step(engine, comm, program, o, done, corpus, lead);
  }
  if (!stopped) examples::export_model(engine, o, corpus, lead);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& c = engine.last_step_comm();  // the shard group's, under --shard-group-size
  const int zero_ranks = engine.comm().size();
  const double f = zero_ranks > 1 ? double(zero_ranks - 1) / zero_ranks : 0.0;
  // Stage 3 gathers twice (forward, backward) and reduce-scatters; modules kept after forward
  // gather once. Stages 1 and 2 reduce-scatter and gather once.
  std::size_t moved = 2 * L.total();
  if (Stage == 3)
    for (int m = 0; m < L.module_count(); ++m)
      moved += engine.keeps_after_forward(m) ? 0 : L.module(m).size;
  const double want = f * double(moved * sizeof(T));
  if (lead && first_step < done) {  // a checkpoint at or past --steps: nothing trained
    std::printf("\nsummary: loss %.4f -> %.4f in %d steps (%lld updates, %llu skipped), %.1f s\n",
                progress.first_loss(), progress.last_loss(), done - first_step,
                static_cast<long long>(engine.steps()),
                static_cast<unsigned long long>(progress.skipped()), secs);
    examples::print_memory(engine.memory());
    examples::print_step_times(sum, done - first_step - 1);
    std::printf(
        "communication per rank, last step: %.3f MB bus (ZeRO formula without persistence %.3f "
        "MB), "
        "%llu calls; total %.3f GB\n",
        c.total().bus_bytes / 1e6, want / 1e6, static_cast<unsigned long long>(c.total().calls),
        double(comm.stats().total().bytes + examples::engine_group_bytes(engine)) / 1e9);
  }
}

template <class B>
void dispatch(zp::Collective<B>& comm, const Options& o, const Corpus& c) {
  examples::with_engine<B>(
      program, o, o, comm.size(), comm.rank() == 0, std::uint64_t(Dims{}.hidden),
      examples::small_model_buckets(),
      [&]<class E>(std::type_identity<E>, const zp::EngineConfig& ec, const zp::optim::AdamW& opt,
                   const zp::schedule::Any& sched) { train<E>(comm, o, c, ec, opt, sched); });
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const Corpus corpus = examples::load_corpus_or_exit(program, o.text, 100);
  return examples::launch(program, argc, argv, o, [&](auto& comm) { dispatch(comm, o, corpus); });
}
