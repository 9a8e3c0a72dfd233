// examples/gpt_hf.hpp: gpt.hpp's model as a Hugging Face GPT-2 directory (needs zp::io):
// config.json (GPT2LMHeadModel, GPT-2's keys: vocab_size, n_positions, n_embd, n_layer, n_head,
// activation "gelu_new", layer_norm_epsilon, tie_word_embeddings false) and model.safetensors
// (fp32, metadata format "pt") with Hugging Face's names and shapes: "transformer." before every
// name but lm_head's, vectors 1-D, matrices [rows, cols] as gpt.hpp stores them (GPT-2's Conv1D
// layout), and lm_head.weight transposed to nn.Linear's [V, d].
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpt.hpp"
#include "zp/detail/file.hpp"
#include "zp/safetensors.hpp"

namespace gpt {

// Hugging Face's name of a gpt.hpp tensor.
inline std::string hf_name(const std::string& name) {
  return name == "lm_head.weight" ? name : "transformer." + name;
}

// The whole model's parameters in forward order (Engine::gather_params, or the tensors of a
// Model of one rank) -> dir/config.json and dir/model.safetensors.
template <class T>
void write_hf(const Config& c, std::span<const T> whole, const std::filesystem::path& dir) {
  const Model<T> layout(c, 0);  // the tensors' names and shapes, in forward order
  std::vector<zp::safetensors::TensorInfo> infos;
  std::size_t total = 0;
  for (const auto& t : layout.tensors()) {
    const std::uint64_t rows = t.slice.rows, cols = t.slice.cols;
    std::vector<std::uint64_t> shape =
        rows == 1 ? std::vector<std::uint64_t>{cols} : std::vector<std::uint64_t>{rows, cols};
    if (t.name == "lm_head.weight") shape = {cols, rows};
    infos.push_back({hf_name(t.name), "F32", shape});
    total += t.slice.full_size();
  }
  ZP_EXPECT(whole.size() == total, "gpt: write_hf got ", whole.size(),
            " parameters; the model of this config has ", total);
  std::filesystem::create_directories(dir);
  zp::safetensors::Writer w(dir / "model.safetensors", infos, {{"format", "pt"}});
  std::size_t at = 0;
  std::vector<float> buf;
  for (const auto& t : layout.tensors()) {
    const std::size_t n = t.slice.full_size(), rows = t.slice.rows, cols = t.slice.cols;
    buf.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float v = float(whole[at + i]);
      if (t.name == "lm_head.weight")
        buf[(i % cols) * rows + i / cols] = v;  // [d, V] -> [V, d]
      else
        buf[i] = v;
    }
    w.write(std::span<const float>(buf));
    at += n;
  }
  w.commit();
  const nlohmann::ordered_json config = {{"architectures", {"GPT2LMHeadModel"}},
                                         {"model_type", "gpt2"},
                                         {"vocab_size", c.vocab},
                                         {"n_positions", c.context},
                                         {"n_embd", c.d_model},
                                         {"n_layer", c.layers},
                                         {"n_head", c.heads},
                                         {"n_inner", 4 * c.d_model},
                                         {"activation_function", "gelu_new"},
                                         {"layer_norm_epsilon", 1e-5},
                                         {"tie_word_embeddings", false},
                                         {"scale_attn_weights", true},
                                         {"resid_pdrop", 0.0},
                                         {"embd_pdrop", 0.0},
                                         {"attn_pdrop", 0.0},
                                         {"torch_dtype", "float32"}};
  const std::string text = config.dump(2) + "\n";
  zp::detail::write_file_atomic(dir / "config.json", std::as_bytes(std::span<const char>(text)));
}

}  // namespace gpt
