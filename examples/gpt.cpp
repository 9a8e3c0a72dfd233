// zp_gpt: the GPT-style transformer of examples/gpt.hpp trained with ZeRO data parallelism on
// the same text as zp_demo, predicting every next character of each window of --context.
//
//   zp_gpt [--stage 0-3] [--backend threads|mpi] [--ranks N] [--precision fp32|bf16|fp16]
//          [--accum N] [--steps N] [--micro-batch N] [--lr X] [--log-every N] [--text PATH]...
//          [--layers N] [--d-model N] [--heads N] [--context N]
//
// The training loop is zp_demo's: each module (the embeddings, every block, the head) runs
// inside the engine's forward and backward guards, and the progress line and summary read the
// same.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <stdexcept>
#include <string>

#include "common.hpp"
#include "gpt.hpp"
#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/schedule.hpp"

namespace {

struct Options : examples::TrainFlags {
  int layers = 2, d_model = 64, heads = 4, context = 32;
  Options() {
    steps = 300;
    micro_batch = 8;
    log_every = 25;
  }
};

const char* usage =
    "usage: zp_gpt [options]\n"
    "  --stage S          ZeRO stage 0, 1, 2 or 3 (default 3)\n"
    "  --backend B        threads or mpi (mpi: run under mpirun, one process per rank) (default threads)\n"
    "  --ranks N          thread ranks for the threads backend (default 4)\n"
    "  --precision P      fp32, bf16 or fp16 (fp16 uses dynamic loss scaling) (default bf16)\n"
    "  --accum N          gradient accumulation steps (default 1)\n"
    "  --steps N          optimizer steps (default 300)\n"
    "  --micro-batch N    sequences per rank per micro-step (default 8)\n"
    "  --lr X             peak learning rate of AdamW, warmup + cosine (default 3e-3)\n"
    "  --log-every N      progress line every N steps (default 25)\n"
    "  --text PATH        training text, repeatable (default: /usr/share/common-licenses/*)\n"
    "  --layers N         transformer blocks (default 2)\n"
    "  --d-model N        width of the residual stream (default 64)\n"
    "  --heads N          attention heads; must divide --d-model (default 4)\n"
    "  --context N        tokens per sequence, the learned positions (default 32)\n"
    "  --help             this text\n";

const examples::Program program{"zp_gpt", usage};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) examples::bad(program, "unknown flag or missing value: '" + a + "'");
    const std::string v = argv[++i];
    if (examples::parse_train_flag(program, o, a, v)) continue;
    if (a == "--layers") o.layers = examples::to_int(program, a, v, 1, 1024);
    else if (a == "--d-model") o.d_model = examples::to_int(program, a, v, 1, 65536);
    else if (a == "--heads") o.heads = examples::to_int(program, a, v, 1, 1024);
    else if (a == "--context") o.context = examples::to_int(program, a, v, 1, 65536);
    else examples::bad(program, "unknown flag '" + a + "'");
  }
  if (o.d_model % o.heads != 0)
    examples::bad(program, "--heads " + std::to_string(o.heads) + " does not divide --d-model " + std::to_string(o.d_model));
  examples::default_text(program, o.text);
  return o;
}

template <class E, class B>
void train(zp::Collective<B>& comm, const Options& o, const examples::Corpus& corpus) {
  using T = typename E::value_type;
  constexpr int Stage = E::stage;
  const int n = comm.size(), r = comm.rank();
  const bool lead = r == 0;
  const gpt::Config cfg{.vocab = int(corpus.chars.size()), .context = o.context, .d_model = o.d_model,
                        .heads = o.heads, .layers = o.layers};
  gpt::Model<T> model(cfg, 1234);  // the same initial weights on every rank
  // zp_demo's engine settings: several buckets even for a small model, small tensors persist.
  zp::EngineConfig ec;
  ec.batch = {.micro_batch_per_rank = o.micro_batch, .gradient_accumulation_steps = o.accum};
  ec.max_grad_norm = 1.0f;
  ec.bucket_bytes = std::size_t(256) << 10;
  ec.first_bucket_bytes = std::size_t(64) << 10;
  ec.persist_threshold = 10000;
  ec.steps_per_print = o.log_every;
  if (o.precision == "fp16") ec.loss_scaler = zp::LossScaler::dynamic({.initial_scale = 65536.0f, .window = 100});
  E engine(comm, model, ec, zp::optim::AdamW{.lr = o.lr, .weight_decay = 0.01f});
  const zp::schedule::Any schedule =
      zp::schedule::WarmupCosineLR{.base_lr = o.lr, .total_num_steps = o.steps, .warmup_num_steps = std::max(1, o.steps / 20),
                                   .cos_min_ratio = 0.1, .warmup_type = zp::schedule::Warmup::linear};
  const int micro_batch = o.micro_batch, accum = o.accum;

  const auto& L = engine.layout();
  if (lead) {
    std::printf("zp_gpt: GPT on %zu characters (vocabulary %d): %d layers, d_model %d, %d heads, context %d; "
                "%zu parameters in %d modules, %d buckets\n",
                corpus.ids.size(), cfg.vocab, cfg.layers, cfg.d_model, cfg.heads, cfg.context, L.used(),
                L.module_count(), L.segment_count());
    std::printf("        ZeRO stage %d, backend %s, %d ranks, %s, micro-batch %d x accumulation %d x ranks %d = %lld sequences/step\n",
                Stage, B::name, n, zp::name(zp::dtype_of<T>), micro_batch, accum, n,
                static_cast<long long>(engine.batch().train_batch_size));
  }
  // Windows of context + 1 characters: the first context are the input, the last context the
  // targets. Each micro-batch depends only on (rank, step, micro-step), as in zp_demo.
  const std::size_t last_start = corpus.ids.size() - std::size_t(cfg.context) - 1;
  std::uniform_int_distribution<std::size_t> pick(0, last_start);
  gpt::Activations<float> act(cfg, micro_batch);
  auto next_batch = [&](int step, int a) {
    std::mt19937_64 rng((std::uint64_t(step) * 1024 + std::uint64_t(a)) * 1000003ull + std::uint64_t(r) * 7919 + 17);
    for (int b = 0; b < micro_batch; ++b) {
      const std::size_t s = pick(rng);
      for (int t = 0; t < cfg.context; ++t) {
        act.tokens[std::size_t(b * cfg.context + t)] = corpus.ids[s + std::size_t(t)];
        act.targets[std::size_t(b * cfg.context + t)] = corpus.ids[s + std::size_t(t) + 1];
      }
    }
  };

  const auto t0 = std::chrono::steady_clock::now();
  examples::Progress progress(o.log_every, 0, o.steps);
  const int modules = model.modules();
  for (int step = 0; step < o.steps; ++step) {
    engine.optimizer().lr = float(zp::schedule::lr(schedule, engine.steps()));
    double loss = 0;
    zp::StepResult res;
    for (int a = 0; a < accum; ++a) {
      next_batch(step, a);
      for (int m = 0; m < modules; ++m) {
        auto g = engine.forward(m);
        model.forward(m, act);
      }
      loss += double(model.loss(act, engine.loss_scale())) / accum;
      for (int m = modules - 1; m >= 0; --m) {
        auto g = engine.backward(m);
        model.backward(m, act);
      }
      res = engine.step();
    }
    progress.step(comm, engine, step, loss, res, std::int64_t(micro_batch) * cfg.context * accum * n);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (lead) {
    std::printf("\nsummary: loss %.4f -> %.4f in %d steps (%lld updates, %llu skipped), %.1f s, %.0f tokens/s\n",
                progress.first_loss(), progress.last_loss(), o.steps, static_cast<long long>(engine.steps()),
                static_cast<unsigned long long>(progress.skipped()), secs,
                double(o.steps) * micro_batch * cfg.context * accum * n / secs);
    examples::print_memory(engine.memory());
  }
}

template <class T, class B>
void dispatch_stage(zp::Collective<B>& comm, const Options& o, const examples::Corpus& c) {
  switch (o.stage) {
    case 0: return train<zp::Engine<B, T, 0>>(comm, o, c);
    case 1: return train<zp::Engine<B, T, 1>>(comm, o, c);
    case 2: return train<zp::Engine<B, T, 2>>(comm, o, c);
    default: return train<zp::Engine<B, T, 3>>(comm, o, c);
  }
}

template <class B>
void dispatch(zp::Collective<B>& comm, const Options& o, const examples::Corpus& c) {
  if (o.precision == "fp32") return dispatch_stage<float>(comm, o, c);
  if (o.precision == "fp16") return dispatch_stage<zp::fp16>(comm, o, c);
  return dispatch_stage<zp::bf16>(comm, o, c);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const examples::Corpus corpus = examples::load_corpus_or_exit(program, o.text, std::size_t(o.context) + 100);
  return examples::launch(program, argc, argv, o.backend, o.ranks, [&](auto& comm) { dispatch(comm, o, corpus); });
}
