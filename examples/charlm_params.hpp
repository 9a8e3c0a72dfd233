// examples/charlm_params.hpp: zp_demo's model as zp sees it: its dimensions, parameters, names and
// initial values, shared by the CPU trainer (charlm.cpp) and the GPU one (charlm_device.cpp), so both
// train the same model from the same weights. Modules: 0 = the embedding, 1 and 2 = the tanh
// layers, 3 = the softmax output layer; each layer's weight is [out, in] row-major.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "zp/model.hpp"

namespace examples {

struct Dims {
  int vocab = 0, embed = 24, context = 16, hidden = 256;
};

template <class T>
struct CharLmParams {
  struct Dense {
    int in = 0, out = 0;
    zp::Param<T> w, b;
    std::vector<T> w0, b0;  // initial values until zp rebinds the views
  };
  static constexpr int modules = 4;
  Dims d;
  zp::Param<T> emb;
  std::vector<T> emb0;
  Dense layer[3];  // hidden1, hidden2, output

  explicit CharLmParams(Dims dims, std::uint64_t seed = 1) : d(dims) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    emb = zp::Param<T>(std::size_t(d.vocab) * std::size_t(d.embed));
    for (std::size_t i = 0; i < emb.size(); ++i) emb0.push_back(T(0.5f * u(rng)));
    emb.value.rebind(emb0.data());
    const int ins[3] = {d.context * d.embed, d.hidden, d.hidden},
              outs[3] = {d.hidden, d.hidden, d.vocab};
    for (int l = 0; l < 3; ++l) {
      Dense& L = layer[l];
      L.in = ins[l];
      L.out = outs[l];
      L.w = zp::Param<T>(std::size_t(L.in) * std::size_t(L.out));
      L.b = zp::Param<T>(std::size_t(L.out));
      const float s = (l == 2 ? 0.5f : 1.0f) / std::sqrt(float(L.in));
      for (std::size_t i = 0; i < L.w.size(); ++i) L.w0.push_back(T(s * u(rng)));
      L.b0.assign(L.b.size(), T(0.0f));
      L.w.value.rebind(L.w0.data());
      L.b.value.rebind(L.b0.data());
    }
  }
  CharLmParams(const CharLmParams&) = delete;
  CharLmParams& operator=(const CharLmParams&) = delete;

  template <class V>
  friend void for_each_parameter(CharLmParams& m, V&& visit) {
    visit("embedding", 0, m.emb);
    visit("hidden1.weight", 1, m.layer[0].w);
    visit("hidden1.bias", 1, m.layer[0].b);
    visit("hidden2.weight", 2, m.layer[1].w);
    visit("hidden2.bias", 2, m.layer[1].b);
    visit("output.weight", 3, m.layer[2].w);
    visit("output.bias", 3, m.layer[2].b);
  }
};

}  // namespace examples
