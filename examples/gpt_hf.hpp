// examples/gpt_hf.hpp: gpt.hpp's model as a Hugging Face GPT-2 directory, out and in (needs zp::io):
// config.json (GPT2LMHeadModel, GPT-2's keys: vocab_size, n_positions, n_embd, n_layer, n_head,
// activation "gelu_new", layer_norm_epsilon, tie_word_embeddings false) and model.safetensors
// (fp32, metadata format "pt") with Hugging Face's names and shapes: "transformer." before every
// name but lm_head's, vectors 1-D, matrices [rows, cols] as gpt.hpp stores them (GPT-2's Conv1D
// layout), and lm_head.weight transposed to nn.Linear's [V, d]. read_hf takes such a directory
// back, or one transformers' save_pretrained wrote for a GPT-2 config of the model's shape (tied
// head: lm_head is wte's transpose; more positions: the first `context` rows of wpe are used).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpt.hpp"
#include "zp/checkpoint_format.hpp"
#include "zp/detail/file.hpp"
#include "zp/safetensors.hpp"

namespace gpt {

// Hugging Face's name of a gpt.hpp tensor.
inline std::string hf_name(const std::string& name) {
  return name == "lm_head.weight" ? name : "transformer." + name;
}

// Hugging Face's shape of a gpt.hpp tensor: vectors 1-D, matrices [rows, cols], lm_head as
// nn.Linear's [V, d] (the transpose of gpt.hpp's [d, V]).
template <class Tensor>
std::vector<std::uint64_t> hf_shape(const Tensor& t) {
  if (t.rows == 1) return {t.cols};
  if (t.name == "lm_head.weight") return {t.cols, t.rows};
  return {t.rows, t.cols};
}

// Whether `name` is a tensor of a Hugging Face GPT-2 of c's depth: a parameter, or the attention
// mask buffers older transformers saved (h.{l}.attn.bias and attn.masked_bias).
inline bool hf_gpt2_tensor(const std::string& name, const Config& c) {
  for (const char* n : {"transformer.wte.weight", "transformer.wpe.weight",
                        "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"})
    if (name == n) return true;
  for (int l = 0; l < c.layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    if (!name.starts_with(h)) continue;
    const std::string rest = name.substr(h.size());
    if (rest == "attn.bias" || rest == "attn.masked_bias") return true;
    for (const char* t : block_tensor_names)
      if (rest == t) return true;
  }
  return false;
}

// The values `whole` (a whole model's parameters in forward order, as Engine::gather_params
// returns them) of a model laid out as `layout` (one rank's Model holding every module and the
// whole vocabulary: a data-parallel grid) -> dir/config.json and dir/model.safetensors.
template <class T>
void write_hf(const Model<T>& layout, std::span<const T> whole, const std::filesystem::path& dir) {
  const Config& c = layout.config();
  ZP_EXPECT(layout.whole(),
            "gpt: write_hf needs the whole model on one rank (no tensor or pipeline split)");
  std::vector<zp::safetensors::TensorInfo> infos;
  std::size_t total = 0;
  for (const auto& t : layout.tensors()) {
    infos.push_back({hf_name(t.name), "F32", hf_shape(t)});
    total += t.place.full_size();
  }
  ZP_EXPECT(whole.size() == total, "gpt: write_hf got ", whole.size(),
            " parameters; the model of this config has ", total);
  std::filesystem::create_directories(dir);
  zp::safetensors::Writer w(dir / "model.safetensors", infos, {{"format", "pt"}});
  std::size_t at = 0;
  std::vector<float> buf;
  for (const auto& t : layout.tensors()) {
    const std::size_t n = t.place.full_size(), rows = t.rows, cols = t.cols;
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
                                         {"bos_token_id", nullptr},  // characters: no special
                                         {"eos_token_id", nullptr},  // tokens
                                         {"scale_attn_weights", true},
                                         {"resid_pdrop", 0.0},
                                         {"embd_pdrop", 0.0},
                                         {"attn_pdrop", 0.0},
                                         {"torch_dtype", "float32"}};
  const std::string text = config.dump(2) + "\n";
  zp::detail::write_file_atomic(dir / "config.json", std::as_bytes(std::span<const char>(text)));
}

// dir/config.json and dir/model.safetensors (or the shards its index names) -> the parameters of
// `m`, this rank's part of the model (any grid: each tensor is read whole, one at a time, and
// the part's elements taken from it). Another architecture, a shape that differs from m's
// config, a config key of another JSON type, a missing tensor, a tensor of another shape, an
// element type other than F32 or a tensor GPT-2 does not have (but the attention mask buffers
// older transformers saved, which are ignored) is an error naming it.
template <class T>
void read_hf(Model<T>& m, const std::filesystem::path& dir) {
  const Config& c = m.config();
  const auto cfg_path = dir / "config.json";
  // A regular file of at most 16 MiB (a FIFO is refused, not waited on).
  const std::string text = zp::detail::read_whole_file(cfg_path, std::uint64_t(16) << 20);
  const nlohmann::json j = zp::detail::parse_json(text, cfg_path.string(), zp::Errc::io);
  ZP_EXPECT(j.is_object(), cfg_path.string(), ": not a JSON object");
  bool tied = true;
  long long positions = 0;
  try {  // a key of the wrong JSON type is an error naming the file, as a missing one is
    const auto num = [&](const char* key) {
      ZP_EXPECT(j.contains(key) && j[key].is_number_integer() &&
                    (!j[key].is_number_unsigned() ||
                     j[key].get<std::uint64_t>() <= std::uint64_t(INT64_MAX)),
                cfg_path.string(), ": no integer '", key, "' (",
                j.contains(key) ? zp::detail::json_excerpt(j[key]) : "missing", ")");
      return j[key].get<long long>();
    };
    // An optional key: its value, which must have the type of `absent` (GPT-2's value).
    const auto optional = [&]<class V>(const char* key, V absent) {
      if (!j.contains(key) || j[key].is_null()) return absent;
      const auto& v = j[key];
      const bool typed = std::is_same_v<V, bool>          ? v.is_boolean()
                         : std::is_same_v<V, std::string> ? v.is_string()
                                                          : v.is_number();
      ZP_EXPECT(typed, cfg_path.string(), ": ", key, " is ", zp::detail::json_excerpt(v),
                ", not a ",
                std::is_same_v<V, bool>          ? "boolean"
                : std::is_same_v<V, std::string> ? "string"
                                                 : "number");
      return v.template get<V>();
    };
    ZP_EXPECT(optional("model_type", std::string()) == "gpt2", cfg_path.string(),
              ": model_type is '", zp::detail::text_excerpt(optional("model_type", std::string())),
              "', not gpt2");
    if (j.contains("architectures") && !j["architectures"].is_null())  // (what it builds)
      ZP_EXPECT(j["architectures"] == nlohmann::json::array({"GPT2LMHeadModel"}), cfg_path.string(),
                ": architectures is ", zp::detail::json_excerpt(j["architectures"]),
                ", not [\"GPT2LMHeadModel\"]");
    const auto same = [&](const char* key, long long want, const char* what) {
      ZP_EXPECT(num(key) == want, cfg_path.string(), ": ", key, " ", num(key), " is not this ",
                what, " (", want, ")");
    };
    same("vocab_size", c.vocab, "model's vocabulary, the training text's characters");
    same("n_embd", c.d_model, "model's --d-model");
    same("n_layer", c.layers, "model's --layers");
    same("n_head", c.heads, "model's --heads");
    ZP_EXPECT(num("n_positions") >= c.context, cfg_path.string(), ": n_positions ",
              num("n_positions"), " is less than --context ", c.context);
    ZP_EXPECT(!j.contains("n_inner") || j["n_inner"].is_null() || j["n_inner"] == 4 * c.d_model,
              cfg_path.string(), ": n_inner ", zp::detail::json_excerpt(j["n_inner"]),
              " is not 4 x n_embd");
    const std::string act = optional("activation_function", std::string("gelu_new"));
    ZP_EXPECT(act == "gelu_new", cfg_path.string(), ": activation_function '",
              zp::detail::text_excerpt(act), "' is not gelu_new, the tanh GELU of this model");
    // The keys that change GPT-2's arithmetic must hold this model's values (absent: GPT-2's).
    const double eps = optional("layer_norm_epsilon", 1e-5);
    ZP_EXPECT(eps == 1e-5, cfg_path.string(), ": layer_norm_epsilon ", eps,
              " is not 1e-05, this model's");
    for (const auto& [key, want] : {std::pair{"scale_attn_weights", true},
                                    {"scale_attn_by_inverse_layer_idx", false},
                                    {"add_cross_attention", false}})
      ZP_EXPECT(optional(key, want) == want, cfg_path.string(), ": ", key, " is ",
                want ? "false" : "true", "; this model has GPT-2's ", want ? "true" : "false");
    tied = optional("tie_word_embeddings", true);
    positions = num("n_positions");
  } catch (const nlohmann::json::exception& e) {
    throw zp::Error(zp::Errc::invalid_argument, cfg_path.string() + ": " + e.what());
  }
  // model.safetensors, or the files model.safetensors.index.json maps the tensors to (what
  // save_pretrained writes for a model past its max_shard_size), each opened once.
  const std::map<std::string, std::filesystem::path> files = zp::ckpt::safetensors_files(dir);
  for (const auto& [name, file] : files)
    ZP_EXPECT(hf_gpt2_tensor(name, c), file.string(), ": tensor '", zp::detail::text_excerpt(name),
              "' is not one of GPT-2's with n_layer ", c.layers);
  std::map<std::filesystem::path, zp::safetensors::Reader> open;
  std::vector<float> buf;
  const auto read = [&](const std::string& name, std::vector<std::uint64_t> shape) {
    const auto file = files.find(name);
    ZP_EXPECT(file != files.end(), dir.string(), ": no tensor named '", name, "'");
    auto r = open.find(file->second);
    if (r == open.end())
      r = open.emplace(file->second, zp::safetensors::Reader(file->second)).first;
    const auto& t = r->second.at(name);
    ZP_EXPECT(t.shape == shape, r->second.path().string(), ": tensor '", name, "' has shape ",
              nlohmann::json(t.shape).dump(), ", not ", nlohmann::json(shape).dump());
    buf.resize(std::size_t(t.elements()));
    r->second.read_elements(name, 0, std::span<float>(buf));
  };
  const std::size_t V = std::size_t(c.vocab), d = std::size_t(c.d_model);
  std::size_t k = 0;
  zp::visit_parameters<T>(m, [&](std::string_view name_, int, zp::View<T>& v, zp::View<T>&) {
    const std::string name(name_);
    const auto& t = m.tensors()[k++];
    const zp::Placement& part = t.place;
    if (name == "lm_head.weight") {  // [d, V] here, nn.Linear's [V, d] there (or wte, tied)
      read(tied && !files.contains(name) ? hf_name("wte.weight") : name, {V, d});
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::size_t f = part.full_index(i);
        v[i] = T(buf[(f % V) * d + f / V]);
      }
      return;
    }
    if (name == "wpe.weight")
      read(hf_name(name), {std::uint64_t(positions), d});  // the first rows are used
    else
      read(hf_name(name), hf_shape(t));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = T(buf[part.full_index(i)]);
  });
}

}  // namespace gpt
