// The C++ half of zp.test.gpt.hf (tests/gpt_hf_check.py drives it):
//   gpt_hf_export <dir> <seed> [<Hugging Face directory>]
// builds a small gpt::Model<float> with every parameter random (layer norms too, so no tensor is
// trivially 1 or 0), or read from the directory with gpt::read_hf (what zp_gpt --init-from does),
// computes its logits on random tokens and the mean loss of predicting each next token (as
// transformers' labels=tokens does), writes the model as a Hugging Face GPT-2 directory with
// gpt::write_hf (<dir>/hf) and the tokens, logits and loss to <dir>/expected.safetensors
// ("tokens" I32 [B, T], "logits" F32 [B, T, V], "loss" F32 [1]).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <random>
#include <vector>

#include "gpt_hf.hpp"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: gpt_hf_export <dir> <seed> [<Hugging Face directory>]\n");
    return 2;
  }
  try {
    const std::filesystem::path dir = argv[1];
    std::mt19937_64 rng(std::strtoull(argv[2], nullptr, 10));
    std::normal_distribution<float> normal(0.0f, 0.3f);
    const gpt::Config c{.vocab = 13, .context = 8, .d_model = 16, .heads = 4, .layers = 2};
    gpt::Model<float> m(c, 1);
    std::vector<float> whole;
    if (argc == 4) gpt::read_hf(m, argv[3]);
    zp::visit_parameters<float>(m,
                                [&](std::string_view, int, zp::View<float>& v, zp::View<float>&) {
                                  for (std::size_t i = 0; i < v.size(); ++i)
                                    whole.push_back(argc == 4 ? v[i] : (v[i] = normal(rng)));
                                });
    const int B = 2;
    gpt::Activations<float> a(c, B);
    std::uniform_int_distribution<int> token(0, c.vocab - 1);
    for (auto& t : a.tokens) t = token(rng);
    for (std::size_t i = 0; i < a.targets.size(); ++i)  // the next token; none after the last
      a.targets[i] = (i + 1) % std::size_t(c.context) ? a.tokens[i + 1] : zp::tp::ignore_index;
    for (int mod = 0; mod < m.modules(); ++mod) m.forward(mod, a);
    const float loss = m.loss(a, 1.0f);
    gpt::write_hf(m, std::span<const float>(whole), dir / "hf");
    const std::uint64_t T = std::uint64_t(c.context), V = std::uint64_t(c.vocab);
    zp::safetensors::Writer w(dir / "expected.safetensors",
                              {{"tokens", "I32", {std::uint64_t(B), T}},
                               {"logits", "F32", {std::uint64_t(B), T, V}},
                               {"loss", "F32", {1}}});
    w.write(std::span<const int>(a.tokens));
    w.write(std::span<const float>(a.logits));
    w.write(std::span<const float>(&loss, 1));
    w.commit();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_hf_export: %s\n", e.what());
    return 1;
  }
  return 0;
}
