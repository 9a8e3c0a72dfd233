// zp_gpt: the GPT-style transformer of examples/gpt.hpp trained on the same text as zp_demo (or
// on llm.c's token files, --tokens), predicting every next character (token) of each window of
// --context, on a DP x TP x PP grid: ZeRO over the data-parallel ranks, Megatron's tensor
// parallelism inside each layer, the layers cut into pipeline stages run by GPipe or 1F1B.
//
//   zp_gpt [--stage 0-3] [--backend threads|mpi] [--ranks N] [--tp N] [--pp N] [--schedule 1f1b|gpipe]
//          [--precision fp32|bf16|fp16] [--accum N] [--steps N] [--micro-batch N] [--lr X]
//          [--init-seed N] [--log-every N] [--text PATH]... [--tokens PATH]... [--vocab N]
//          [--layers N] [--d-model N] [--heads N]
//          [--context N] [--checkpoint-dir DIR] [--save-every N] [--resume] [--export DIR]
//          [--recompute] [--decay all|matrices] [--wall-clock-breakdown] [--log-json PATH]
//          [--config ds_config.json]
//          [--sample N] [--prompt TEXT] [--temperature X] [--top-k N] [--seed N] [--eval PATH]
//          [--eval-every N]
//
// A run saved with --checkpoint-dir/--save-every resumes with --resume on any grid (--ranks,
// --tp, --pp), --stage or --backend: each rank saves its part of the model with where it sits
// in the full tensors, and each rank of the new grid reads its own part.
// --export DIR writes a Hugging Face GPT-2 directory (config.json, model.safetensors) with a
// text's vocabulary (vocab.json), and --init-from DIR starts from one, on any grid. --sample N
// prints N characters (token ids) the trained model generates after --prompt; with --resume and
// no steps left (--steps equal to the checkpoint's), it samples from the checkpoint. --eval PATH
// prints the trained (or, with --steps 0, the loaded) model's mean loss of predicting every next
// character (token) of PATH; with --eval-every N, also every N steps.
//
// The training loop is gpt::train_step: each module (the embeddings, every block, the head)
// runs inside the engine's forward and backward guards, the progress line and summary read as
// zp_demo's.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common.hpp"
#include "run_control.hpp"
#include "gpt.hpp"
#include "tokens.hpp"
#if ZP_DEMO_IO
#include "gpt_hf.hpp"
#endif
#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/grid.hpp"
#include "zp/pipeline.hpp"
#include "zp/schedule.hpp"

namespace {

struct Options : examples::TrainFlags, examples::RunFlags {
  int layers = 2, d_model = 64, heads = 4, context = 32, tp = 1, pp = 1;
  bool recompute = false;        // --recompute: activation checkpointing (gpt::Activations)
  bool estimate_memory = false;  // --estimate-memory: print Engine::estimate_memory, no training
  int eval_every = 0;            // --eval-every: --eval's loss every N steps too
  bool decay_matrices = false;   // --decay matrices: gpt::is_matrix as the weight decay filter
  std::string prompt = "\n", init_from, eval;
  std::vector<std::string> tokens;  // --tokens: llm.c's token files, in place of --text
  int vocab = 50257;                // --vocab: the token ids' range with --tokens (GPT-2's)
  gpt::SampleOptions sampling;
  zp::pipeline::Schedule schedule = zp::pipeline::Schedule::one_f_one_b;
  Options() {
    steps = 300;
    micro_batch = 8;
    log_every = 25;
    init_seed = 1234;
  }
};

const char* usage =
    "usage: zp_gpt [options]\n"
    "  --stage S          ZeRO stage 0, 1, 2 or 3 (default 3)\n"
    "  --backend B        threads or mpi (mpi: run under mpirun, one process per rank) (default "
    "threads)\n"
    "  --ranks N          thread ranks for the threads backend (default 4); dp = ranks / (tp * "
    "pp)\n"
    "  --tp N             tensor-parallel ranks per layer; must divide --heads (default 1)\n"
    "  --pp N             pipeline stages, at most --layers + 2 (default 1)\n"
    "  --schedule S       pipeline schedule, 1f1b or gpipe (default 1f1b)\n"
    "  --precision P      fp32, bf16 or fp16 (fp16 uses dynamic loss scaling) (default bf16)\n"
    "  --accum N          micro-batches per step: gradient accumulation, and the pipeline's "
    "(default 1)\n"
    "  --steps N          optimizer steps (default 300)\n"
    "  --micro-batch N    sequences per rank per micro-step (default 8)\n"
    "  --lr X             peak learning rate of AdamW, warmup + cosine (default 3e-3)\n"
    "  --init-seed N      the initial weights' random seed (default 1234)\n"
    "  --offload-optimizer none|cpu|nvme:DIR\n"
    "                     fp32 master weights and optimizer state in host memory (ZeRO-Offload)\n"
    "                     or in a swap file under DIR (ZeRO-Infinity) (default none)\n"
    "  --offload-param none|cpu|nvme:DIR\n"
    "                     stage 3: each rank's 16-bit parameter shard in host memory (where the\n"
    "                     host backends keep it) or in a swap file under DIR (default none)\n"
    "  --log-every N      progress line every N steps (default 25)\n"
    "  --text PATH        training text, repeatable (default: /usr/share/common-licenses/*)\n"
    "  --tokens PATH      train on llm.c's token file (GPT-2's token ids) instead, repeatable;\n"
    "                     --eval is then a token file and --prompt token ids (\"464 2068\")\n"
    "  --vocab N          with --tokens: the token ids' range [0, N) (default 50257, GPT-2's)\n"
    "  --layers N         transformer blocks (default 2)\n"
    "  --d-model N        width of the residual stream (default 64)\n"
    "  --heads N          attention heads; must divide --d-model (default 4)\n"
    "  --context N        tokens per sequence, the learned positions (default 32)\n"
    "  --decay all|matrices  which parameters AdamW's weight decay applies to: all, or the\n"
    "                     matrices only (not biases, not layer norms: GPT-2's practice)\n"
    "                     (default all)\n"
    "  --recompute        keep only each block's input and run its forward again in its\n"
    "                     backward (activation checkpointing): one block's activations in\n"
    "                     memory instead of every block's, for one more forward; bitwise the\n"
    "                     same training\n"
    "  --init-from DIR    start from a Hugging Face GPT-2 directory of this shape (--export's, or\n"
    "                     transformers' save_pretrained), instead of the random initial weights\n"
    "  --sample N         after training, print N characters the model generates (default 0)\n"
    "  --prompt TEXT      the text sampling continues (default a newline)\n"
    "  --temperature X    sampling temperature; 0: always the most likely character (default 1)\n"
    "  --top-k N          sample among the N most likely characters; 0: all (default 0)\n"
    "  --seed N           the sampling's random seed (default 1)\n"
    "  --eval PATH        after training, print the mean loss of predicting every next character\n"
    "                     of the text in PATH (each once, in windows of --context)\n"
    "  --eval-every N     ... and every N steps of training too (a validation loss)\n"
    "  --estimate-memory  print what the engine would allocate per rank for these flags (the\n"
    "                     plan it checks against the memory room before allocating), without\n"
    "                     allocating or training\n";

const examples::Program program{"zp_gpt", usage, examples::run_usage};
constexpr std::initializer_list<const char*> gpt_switches = {"--recompute", "--estimate-memory"};

Options parse(int argc, char** argv) {
  Options o;
  o.given = examples::parse_args(
      program, argc, argv,
      [&](const std::string& a, const std::string& v) {
        if (a == "--recompute") {
          o.recompute = true;
          return true;
        }
        if (a == "--estimate-memory") {
          o.estimate_memory = true;
          return true;
        }
        if (a == "--steps") {  // 0: nothing to train (sample or export what was loaded)
          o.steps = examples::to_int(program, a, v, 0, 10000000);
          return true;
        }
        if (examples::parse_train_flag(program, o, a, v) ||
            examples::parse_run_flag(program, o, a, v))
          return true;
        if (a == "--layers")
          o.layers = examples::to_int(program, a, v, 1, 1024);
        else if (a == "--d-model")
          o.d_model = examples::to_int(program, a, v, 1, 65536);
        else if (a == "--heads")
          o.heads = examples::to_int(program, a, v, 1, 1024);
        else if (a == "--context")
          o.context = examples::to_int(program, a, v, 1, 65536);
        else if (a == "--sample")
          o.sampling.count = examples::to_int(program, a, v, 0, 1000000);
        else if (a == "--init-from")
          o.init_from = v;
        else if (a == "--eval")
          o.eval = v;
        else if (a == "--tokens")
          o.tokens.push_back(v);
        else if (a == "--vocab")
          o.vocab = examples::to_int(program, a, v, 1, 65536);
        else if (a == "--decay") {
          if (v != "all" && v != "matrices")
            examples::bad(program, "--decay expects all or matrices, got '" + v + "'");
          o.decay_matrices = v == "matrices";
        } else if (a == "--eval-every")
          o.eval_every = examples::to_int(program, a, v, 1, 10000000);
        else if (a == "--prompt")
          o.prompt = v;
        else if (a == "--temperature") {
          char* end = nullptr;
          o.sampling.temperature = std::strtod(v.c_str(), &end);
          if (v.empty() || *end != '\0' || !(o.sampling.temperature >= 0) ||
              !std::isfinite(o.sampling.temperature))
            examples::bad(program, "--temperature expects a number >= 0, got '" + v + "'");
        } else if (a == "--top-k")
          o.sampling.top_k = examples::to_int(program, a, v, 0, 1 << 20);
        else if (a == "--seed")
          o.sampling.seed = std::uint64_t(examples::to_int(program, a, v, 0, 2147483647));
        else if (a == "--tp")
          o.tp = examples::to_int(program, a, v, 1, 1024);
        else if (a == "--pp")
          o.pp = examples::to_int(program, a, v, 1, 1024);
        else if (a == "--schedule") {
          if (v == "1f1b")
            o.schedule = zp::pipeline::Schedule::one_f_one_b;
          else if (v == "gpipe")
            o.schedule = zp::pipeline::Schedule::gpipe;
          else
            examples::bad(program, "--schedule expects 1f1b or gpipe, got '" + v + "'");
        } else
          return false;
        return true;
      },
      examples::run_switches, gpt_switches);
  examples::check_run_flags(program, o, o.given);
  if (!o.sampling.count)
    for (const char* f : {"--prompt", "--temperature", "--top-k", "--seed"})
      if (examples::gave(o.given, f))
        examples::bad(program, std::string(f) + " without --sample N: nothing is sampled");
  if (o.eval_every && o.eval.empty())
    examples::bad(program, "--eval-every without --eval PATH: nothing to evaluate");
  if (o.d_model % o.heads != 0)
    examples::bad(program, "--heads " + std::to_string(o.heads) + " does not divide --d-model " +
                               std::to_string(o.d_model));
  if (o.heads % o.tp != 0)
    examples::bad(program, "--tp " + std::to_string(o.tp) + " does not divide --heads " +
                               std::to_string(o.heads));
  if (o.pp > o.layers + 2)
    examples::bad(program, "--pp " + std::to_string(o.pp) + " is more than the " +
                               std::to_string(o.layers + 2) +
                               " modules of the model (--layers + 2)");
  if (!o.tokens.empty() && !o.text.empty())
    examples::bad(program, "--text and --tokens: train on a text or on token files, not both");
  if (o.tokens.empty() && examples::gave(o.given, "--vocab"))
    examples::bad(program, "--vocab without --tokens: a text's vocabulary is its characters");
  if (!o.tokens.empty() && o.sampling.count && !examples::gave(o.given, "--prompt"))
    examples::bad(program, "--sample with --tokens needs --prompt: the token ids to continue");
  if (o.tokens.empty()) examples::default_text(program, o.text);
  return o;
}

// What the run reads, made before any rank starts, so that a file it cannot use, or a character
// or token outside the vocabulary, stops it before training: the windows it trains on, the
// vocabulary, and --prompt's and --eval's ids.
struct Data {
  examples::Corpus corpus;    // the text's characters (id -> byte); none with --tokens
  examples::Windows windows;  // of --context + 1 ids
  int vocab = 0;
  std::vector<int> prompt{}, eval{};  // empty: no --sample, no --eval
  bool tokens() const noexcept { return corpus.chars.empty(); }
};

// --prompt with --tokens: token ids separated by spaces or commas, each below the vocabulary.
std::vector<int> parse_token_ids(const std::string& text, int vocab) {
  std::vector<int> ids;
  for (std::size_t at = 0; at < text.size();) {
    if (text[at] == ' ' || text[at] == ',') {
      ++at;
      continue;
    }
    const std::size_t end = std::min(text.find_first_of(" ,", at), text.size());
    const std::string id = text.substr(at, end - at);
    char* stop = nullptr;
    const long v = std::strtol(id.c_str(), &stop, 10);
    if (!std::isdigit(static_cast<unsigned char>(id[0])) || *stop != '\0' || v >= vocab)
      throw zp::Error(zp::Errc::invalid_argument,
                      zp::detail::cat("--prompt: '", id, "' is not a token id in [0, ", vocab,
                                      ") (with --tokens the prompt is token ids)"));
    ids.push_back(int(v));
    at = end;
  }
  if (ids.empty())
    throw zp::Error(zp::Errc::invalid_argument, "--prompt '" + text + "' holds no token id");
  return ids;
}

// --text's or --tokens' data, or the exit status 1 with the error printed.
Data load_data(const Options& o) {
  const int window = o.context + 1;
  try {
    auto checked = [&](Data d) {
      if (!o.eval.empty() && d.eval.size() < 2)
        throw zp::Error(zp::Errc::invalid_argument,
                        zp::detail::cat("--eval ", o.eval, " is too short: ", d.eval.size(),
                                        d.tokens() ? " token(s)" : " character(s)",
                                        ", at least 2 needed (one prediction)"));
      return d;
    };
    if (o.tokens.empty()) {
      examples::Corpus corpus =
          examples::load_corpus_or_exit(program, o.text, std::size_t(o.context) + 100);
      std::vector<int> ids = std::exchange(corpus.ids, {});
      const int vocab = int(corpus.chars.size());
      Data d{std::move(corpus), examples::Windows(std::move(ids), window), vocab};
      if (o.sampling.count) d.prompt = d.corpus.encode(o.prompt, "--prompt");
      if (!o.eval.empty())
        d.eval = d.corpus.encode(examples::read_text(o.eval, "--eval text"), "--eval " + o.eval);
      return checked(std::move(d));
    }
    std::vector<examples::TokenFile> files;
    for (const std::string& path : o.tokens) files.emplace_back(path, o.vocab);
    Data d{{}, examples::Windows(std::move(files), window), o.vocab};
    if (o.sampling.count) d.prompt = parse_token_ids(o.prompt, o.vocab);
    if (!o.eval.empty()) d.eval = examples::TokenFile(o.eval, o.vocab).ids();
    return checked(std::move(d));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program.name, e.what());
    std::exit(1);
  }
}

// --export: a Hugging Face GPT-2 directory (examples/gpt_hf.hpp: config.json, model.safetensors)
// and, for a text's vocabulary, vocab.json; `model` (a whole model) gives the tensors' names and
// shapes, `whole` their values (Engine::gather_params, assembled over the grid).
template <class T>
void export_hf(const gpt::Model<T>& model, std::span<const T> whole, const Options& o,
               const Data& data) {
#if ZP_DEMO_IO
  gpt::write_hf(model, whole, o.export_dir);
  examples::write_vocab(o.export_dir, data.tokens() ? nullptr : &data.corpus);
  std::printf("exported %s: config.json and model.safetensors (Hugging Face GPT-2)%s\n",
              o.export_dir.c_str(), data.tokens() ? "" : ", vocab.json");
#else
  (void)model, (void)whole, (void)o, (void)data;
#endif
}

// --sample: `model` (the whole model, holding the trained values) continues --prompt: as text,
// or with --tokens as token ids (the prompt's, a bar, the generated ones).
template <class T>
void print_sample(gpt::Model<T>& model, const Options& o, const Data& data) {
  std::string text = o.prompt;
  if (data.tokens()) text += " |";
  for (int id : gpt::sample(model, data.prompt, o.sampling))
    text += data.tokens() ? " " + std::to_string(id)
                          : std::string(1, data.corpus.chars[std::size_t(id)]);
  std::printf("sample (temperature %g, top-k %d, seed %llu%s):\n%s\n", o.sampling.temperature,
              o.sampling.top_k, static_cast<unsigned long long>(o.sampling.seed),
              data.tokens() ? "; token ids" : "", text.c_str());
}

// The model the flags describe.
gpt::Config config_of(const Options& o, const Data& data) {
  return {.vocab = data.vocab,
          .context = o.context,
          .d_model = o.d_model,
          .heads = o.heads,
          .layers = o.layers};
}

// --estimate-memory: rank 0's plan (Engine::estimate_memory: its part of the model, on the
// grid's data-parallel ranks), from a model whose values are never made.
template <class E, class B>
void estimate(zp::ProcessGrid<B>& grid, const Options& o, const Data& data,
              const zp::EngineConfig& ec) {
  using T = typename E::value_type;
  const gpt::Config cfg = config_of(o, data);
  const auto [first, end] = gpt::pipeline_stage(cfg, o.pp, grid.coords().pp);
  gpt::Model<T> model(cfg, o.init_seed, zp::tp::Group<float>(grid.tp()), {first, end},
                      gpt::Model<T>::InitialValues::on_request);
  const zp::MemoryPlan p = E::estimate_memory(model, grid.shape().dp, ec, grid.shape().tp);
  if (grid.world_rank() != 0) return;
  const zp::MemoryReport& m = p.host;
  std::printf(
      "memory plan per rank (MiB, before allocating): params %.3f  grads %.3f  fp32 master %.3f  "
      "optimizer state %.3f  = model states %.3f; buckets %.3f  gathered at least %.3f  "
      "persistent %.3f\n",
      examples::mib(m.params), examples::mib(m.grads), examples::mib(m.master),
      examples::mib(m.optimizer_state), examples::mib(m.model_states()), examples::mib(m.buckets),
      examples::mib(m.gathered - m.persistent), examples::mib(m.persistent));
  if (m.swap_buffers)
    std::printf("        NVMe swap buffers: %.3f MiB\n", examples::mib(m.swap_buffers));
  if (m.secondary)
    std::printf("        secondary shards (hpZ): %.3f MiB\n", examples::mib(m.secondary));
  std::printf("        in all %.3f MiB a rank (%d ranks on this grid); activations come on top\n",
              examples::mib(m.total()), grid.shape().size());
}

// E: the zp::Engine type (backend, element type, stage, optimizer), chosen by the flags or by
// zp::ds::with_engine from a config (examples::with_engine), as are ec, opt and the schedule.
template <class E, class B>
void train(zp::Collective<B>& world, zp::ProcessGrid<B>& grid, const Options& o, const Data& data,
           const zp::EngineConfig& ec, typename E::optimizer_type opt,
           const zp::schedule::Any& schedule) {
  using T = typename E::value_type;
  constexpr int Stage = E::stage;
  const int dp = grid.shape().dp, dp_rank = grid.coords().dp;
  const bool lead = world.rank() == 0;
  const gpt::Config cfg = config_of(o, data);
  const auto [first, end] = gpt::pipeline_stage(cfg, o.pp, grid.coords().pp);
  // The same initial weights on every grid; from a file they are read into the model's views,
  // else the engine asks each rank for only the elements it keeps (at stage 3 its shard).
  const bool from_file = !o.init_from.empty();
  gpt::Model<T> model(
      cfg, o.init_seed, zp::tp::Group<float>(grid.tp()), {first, end},
      from_file ? gpt::Model<T>::InitialValues::held : gpt::Model<T>::InitialValues::on_request);
  zp::EngineConfig with_init = ec;
  if (!from_file) with_init.initializer = model.initializer();
  if (from_file) {
#if ZP_DEMO_IO
    gpt::read_hf(model, o.init_from);  // before the engine takes the initial values
    if (lead) std::printf("zp_gpt: weights from %s\n", o.init_from.c_str());
#else
    throw zp::Error(zp::Errc::invalid_argument,
                    "zp_gpt: built without zp::io (nlohmann_json): no --init-from");
#endif
  }
  // The activation sets and the pipeline's buffers before the engine (the batch it will
  // resolve), so that they are out of the room its memory check reads.
  const zp::BatchConfig batch = zp::resolve_batch(ec.batch, dp);
  const int micro_batch = int(batch.micro_batch_per_rank),
            accum = int(batch.gradient_accumulation_steps);
  const std::size_t rows = std::size_t(micro_batch) * std::size_t(cfg.context);
  zp::pipeline::Runner<B, float> runner(grid.pp(), o.schedule, accum,
                                        rows * std::size_t(cfg.d_model));
  std::vector<gpt::Activations<float>> slots;
  for (int k = 0; k < runner.slots(); ++k) {
    slots.emplace_back(cfg, micro_batch, o.recompute);
    model.reserve(slots.back());
  }
  E engine(grid, model, with_init, opt);
  model.release_initial_values();

  // Every rank's parameter count, summed over the replica's TP x PP ranks.
  std::int64_t params = std::int64_t(engine.layout().used());
  if (auto* mp = engine.model_parallel()) {
    // Replicated tensors are counted once: only TP rank 0 adds them.
    params = 0;
    for (const auto& t : model.tensors())
      if (!t.place.is_whole() || grid.coords().tp == 0) params += std::int64_t(t.place.size());
    mp->all_reduce(std::span<std::int64_t>(&params, 1));
  }
  if (lead) {
    std::printf(
        "zp_gpt: GPT on %zu %s (vocabulary %d): %d layers, d_model %d, %d heads, context %d; "
        "%lld parameters\n",
        data.windows.tokens(),
        data.tokens() ? zp::detail::cat("tokens of ", data.windows.files(), " file(s)").c_str()
                      : "characters",
        cfg.vocab, cfg.layers, cfg.d_model, cfg.heads, cfg.context, static_cast<long long>(params));
    std::printf(
        "        grid dp %d x tp %d x pp %d (%s, %d activation sets on stage 0%s), ZeRO stage %d "
        "over dp, backend %s, %s\n"
        "        micro-batch %d x micro-batches %d x dp %d = %lld sequences/step\n",
        dp, o.tp, o.pp, zp::pipeline::name(o.schedule), runner.slots(),
        o.recompute ? ", blocks recomputed" : "", Stage, B::name, zp::name(zp::dtype_of<T>),
        micro_batch, accum, dp, static_cast<long long>(engine.batch().train_batch_size));
    if (o.decay_matrices)
      std::printf("        weight decay on the matrices only (not biases, not layer norms)\n");
  }
  // Windows of context + 1 ids (characters or tokens): the first context are the input, the last
  // context the targets. Each micro-batch depends only on (data-parallel rank, step, micro-batch),
  // so every TP and PP rank of a replica sees the same data.
  std::uniform_int_distribution<std::size_t> pick(0, data.windows.count() - 1);
  int step = 0;
  std::vector<int> window(data.windows.length());  // one drawn window, inputs and targets
  auto fill = [&](int micro, gpt::Activations<float>& a) {
    std::mt19937_64 rng((std::uint64_t(step) * 1024 + std::uint64_t(micro)) * 1000003ull +
                        std::uint64_t(dp_rank) * 7919 + 17);
    for (int b = 0; b < micro_batch; ++b) {
      data.windows.read(pick(rng), window);
      for (int t = 0; t < cfg.context; ++t) {
        a.tokens[std::size_t(b * cfg.context + t)] = window[std::size_t(t)];
        a.targets[std::size_t(b * cfg.context + t)] = window[std::size_t(t) + 1];
      }
    }
  };

  auto traffic = [&] {
    std::uint64_t bytes = world.stats().total().bytes;
    for (auto* c : {&grid.dp(), &grid.tp(), &grid.pp(), &grid.model_parallel()})
      bytes += c->stats().total().bytes;
    return bytes + examples::engine_group_bytes(engine);
  };
  const std::vector<int>& eval = data.eval;
  // The trained values as one whole model on the lead rank, for f(full, its values) there
  // (the run's own views are the engine's). Collective: every rank gathers its part, and DP rank
  // 0 of each replica assembles the TP x PP parts.
  auto with_whole = [&](auto&& f) {
    std::vector<T> whole = engine.gather_params();  // this rank's part
    if (auto* mp = engine.model_parallel(); mp && dp_rank == 0)
      whole = gpt::gather_whole(model, std::span<const T>(whole), *mp, grid.coords().tp);
    if (!lead) return;
    gpt::Model<T> full(cfg, 0);
    std::size_t at = 0;  // gather_params' order: the whole model's, forward
    zp::visit_parameters<T>(full, [&](std::string_view, int, zp::View<T>& value, zp::View<T>&) {
      std::copy_n(whole.begin() + std::ptrdiff_t(at), value.size(), value.data());
      at += value.size();
    });
    f(full, std::span<const T>(whole));
  };
  auto eval_loss = [&](gpt::Model<T>& full) { return gpt::evaluate(full, eval, micro_batch); };

  const int first_step = examples::resume(engine, world, program, o, data.corpus, o.steps);
  examples::JsonLog json(o, lead);
  const auto t0 = std::chrono::steady_clock::now();
  double eval_secs = 0;  // --eval-every's, left out of the tokens/s
  examples::Progress progress(o.log_every, first_step, o.steps);
  examples::stop_signal::install();
  int done = first_step;  // steps done: o.steps, or fewer where a signal stopped the run
  bool stopped = false;
  for (step = first_step; step < o.steps && !stopped; ++step) {
    engine.optimizer().lr = float(zp::schedule::lr(schedule, engine.steps()));
    const gpt::StepOut r = gpt::train_step(engine, model, runner, slots, fill);
    // The loss lives on the last stage (once per TP group): its mean over the replicas.
    double loss = grid.last_stage() && grid.coords().tp == 0 ? r.loss / dp : 0.0;
    world.all_reduce(std::span<double>(&loss, 1));
    json.line(step + 1, loss, r.result);
    progress.step(world, engine, step, loss, r.result, std::int64_t(rows) * accum * dp, traffic());
    done = step + 1;
    if (o.eval_every && done % o.eval_every == 0) {
      const auto e0 = std::chrono::steady_clock::now();
      with_whole([&](gpt::Model<T>& full, std::span<const T>) {
        std::printf("eval: step %d loss %.7f\n", done, eval_loss(full));
      });
      eval_secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    }
    stopped = examples::end_step(engine, world, program, o, done, data.corpus, lead);
  }
  // One gather for all three; a stopped run does none of them (it goes on from its checkpoint).
  if (!stopped && (!o.export_dir.empty() || o.sampling.count || !eval.empty()))
    with_whole([&](gpt::Model<T>& full, std::span<const T> whole) {
      if (!o.export_dir.empty()) export_hf(full, whole, o, data);
      if (o.sampling.count) print_sample(full, o, data);
      if (!eval.empty())
        std::printf("eval: loss %.7f over the %zu next %s of %s\n", eval_loss(full),
                    eval.size() - 1, data.tokens() ? "tokens" : "characters", o.eval.c_str());
    });
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - eval_secs;
  if (lead && first_step < done) {
    std::printf(
        "\nsummary: loss %.4f -> %.4f in %d steps (%lld updates, %llu skipped), %.1f s, %.0f "
        "tokens/s\n",
        progress.first_loss(), progress.last_loss(), done - first_step,
        static_cast<long long>(engine.steps()), static_cast<unsigned long long>(progress.skipped()),
        secs, double(done - first_step) * double(rows) * accum * dp / secs);
    examples::print_memory(engine.memory());
    std::size_t act = 0;
    for (const auto& a : slots) act += a.bytes();
    std::printf("activations on rank 0 (MiB): %.3f in %zu sets%s\n", examples::mib(act),
                slots.size(), o.recompute ? ", one block's each (--recompute)" : "");
  }
}

template <class B>
void dispatch(zp::Collective<B>& world, const Options& o, const Data& data) {
  const int n = world.size();
  zp::on_every_rank(world, [&] {  // agreed: an MPI job ends with the error, not an abort
    if (n % (o.tp * o.pp) != 0)
      throw zp::Error(zp::Errc::invalid_argument,
                      "zp_gpt: " + std::to_string(n) + " ranks do not divide into --tp " +
                          std::to_string(o.tp) + " x --pp " + std::to_string(o.pp));
  });
  zp::ProcessGrid<B> grid(world, {.dp = n / (o.tp * o.pp), .tp = o.tp, .pp = o.pp});
  examples::with_engine<B>(
      program, o, o, grid.shape().dp, world.rank() == 0, std::uint64_t(o.d_model),
      examples::small_model_buckets(),
      [&]<class E>(std::type_identity<E>, const zp::EngineConfig& ec, const zp::optim::AdamW& opt,
                   const zp::schedule::Any& sched) {
        zp::EngineConfig with_filter = ec;
        if (o.decay_matrices) with_filter.weight_decay_filter = gpt::is_matrix;
        if (o.estimate_memory)
          estimate<E>(grid, o, data, with_filter);
        else
          train<E>(world, grid, o, data, with_filter, opt, sched);
      });
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const Data data = load_data(o);
  return examples::launch(program, argc, argv, o, [&](auto& comm) { dispatch(comm, o, data); });
}
