// tests/zero_mlp.hpp: a small MLP with hand-written forward and backward for the ZeRO tests
// (model, partition, bucket, engine). One module per layer; sizes not divisible by 2, 3 or 4.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "random.hpp"
#include "zp/dtype.hpp"
#include "zp/model.hpp"

namespace zp::test {

// The data set and initial weights of every Mlp in this process: fresh each run (the MPI
// tests use rank 0's on every rank), printed once so a failure can be repeated with
// ZP_TEST_SEED.
inline std::uint64_t& mlp_seed() {
  static std::uint64_t seed = [] {
    const std::uint64_t s = fresh_seed();
    std::printf("zero_mlp: seed %llu (ZP_TEST_SEED=%llu repeats this run)\n", (unsigned long long)s,
                (unsigned long long)s);
    return s;
  }();
  return seed;
}

template <class T>
struct Mlp {
  static constexpr int inputs = 13, classes = 7;
  struct Layer {
    int in, out;
    Param<T> w, b;
    std::vector<T> w0, b0;  // initial values (zp copies them, then the views point into zp)
  };
  std::vector<Layer> layers;
  std::vector<std::vector<float>> act, dact;  // act[l]: input of layer l (batch x in)
  int batch = 0;
  bool poison = false;  // backward writes an inf into layer 0's weight gradient

  explicit Mlp(std::vector<int> widths = {inputs, 61, 67, 53, classes},
               std::uint64_t seed = mlp_seed()) {
    layers.resize(widths.size() - 1);
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      Layer& L = layers[l];
      L.in = widths[l];
      L.out = widths[l + 1];
      L.w = Param<T>(std::size_t(L.in * L.out));
      L.b = Param<T>(std::size_t(L.out));
      const float s = 1.0f / std::sqrt(float(L.in));
      for (std::size_t i = 0; i < L.w.size(); ++i) L.w0.push_back(T(s * hash_uniform(seed + l, i)));
      for (std::size_t i = 0; i < L.b.size(); ++i)
        L.b0.push_back(T(0.1f * hash_uniform(seed + 100 + l, i)));
      L.w.value.rebind(L.w0.data());
      L.b.value.rebind(L.b0.data());
    }
    act.resize(layers.size() + 1);
    dact.resize(layers.size() + 1);
  }
  Mlp(const Mlp&) = delete;
  int modules() const { return int(layers.size()); }

  template <class V>
  friend void for_each_parameter(Mlp& m, V&& visit) {
    for (std::size_t l = 0; l < m.layers.size(); ++l) {
      visit("layer" + std::to_string(l) + ".weight", int(l), m.layers[l].w);
      visit("layer" + std::to_string(l) + ".bias", int(l), m.layers[l].b.value, m.layers[l].b.grad);
    }
  }

  // Samples g0 .. g0 + n - 1 of the data set: inputs and class labels.
  void load(std::int64_t g0, int n, std::vector<int>& labels) {
    batch = n;
    act[0].assign(std::size_t(n * inputs), 0.0f);
    labels.assign(std::size_t(n), 0);
    for (int k = 0; k < n; ++k) {
      float sum = 0;
      for (int i = 0; i < inputs; ++i) {
        const float x =
            hash_uniform(mlp_seed() ^ 0x5eed, std::uint64_t(g0 + k) * inputs + std::uint64_t(i));
        act[0][std::size_t(k * inputs + i)] = x;
        sum += x * float(i % 3 - 1);
      }
      labels[std::size_t(k)] = int(std::floor((std::tanh(sum) + 1.0f) * 0.5f * classes * 0.999f));
    }
  }

  void forward(int l) {
    const Layer& L = layers[std::size_t(l)];
    const bool relu = l + 1 < int(layers.size());
    auto& out = act[std::size_t(l + 1)];
    const auto& in = act[std::size_t(l)];
    out.assign(std::size_t(batch * L.out), 0.0f);
    for (int k = 0; k < batch; ++k)
      for (int o = 0; o < L.out; ++o) {
        float a = float(L.b.value[std::size_t(o)]);
        for (int i = 0; i < L.in; ++i)
          a += float(L.w.value[std::size_t(o * L.in + i)]) * in[std::size_t(k * L.in + i)];
        out[std::size_t(k * L.out + o)] = relu && a < 0 ? 0.0f : a;
      }
  }

  // Mean softmax cross-entropy; seeds dact with d(scale * loss)/d(logits).
  float loss(const std::vector<int>& labels, float scale) {
    const auto& z = act.back();
    auto& d = dact.back();
    d.assign(z.size(), 0.0f);
    double total = 0;
    for (int k = 0; k < batch; ++k) {
      const float* zk = z.data() + k * classes;
      float mx = zk[0];
      for (int c = 1; c < classes; ++c) mx = std::max(mx, zk[c]);
      float se = 0;
      for (int c = 0; c < classes; ++c) se += std::exp(zk[c] - mx);
      total += double(std::log(se) + mx - zk[labels[std::size_t(k)]]);
      for (int c = 0; c < classes; ++c) {
        const float p = std::exp(zk[c] - mx) / se;
        d[std::size_t(k * classes + c)] =
            (p - (c == labels[std::size_t(k)] ? 1.0f : 0.0f)) * scale / float(batch);
      }
    }
    return float(total / batch);
  }

  // Adds this micro-batch's gradient into the grad views (computed in float, added once).
  void backward(int l) {
    Layer& L = layers[std::size_t(l)];
    const auto& in = act[std::size_t(l)];
    const auto& dout = dact[std::size_t(l + 1)];
    std::vector<float> gw(std::size_t(L.in * L.out), 0.0f), gb(std::size_t(L.out), 0.0f);
    for (int k = 0; k < batch; ++k)
      for (int o = 0; o < L.out; ++o) {
        const float g = dout[std::size_t(k * L.out + o)];
        gb[std::size_t(o)] += g;
        for (int i = 0; i < L.in; ++i)
          gw[std::size_t(o * L.in + i)] += g * in[std::size_t(k * L.in + i)];
      }
    for (std::size_t i = 0; i < gw.size(); ++i) L.w.grad[i] = T(float(L.w.grad[i]) + gw[i]);
    for (std::size_t i = 0; i < gb.size(); ++i) L.b.grad[i] = T(float(L.b.grad[i]) + gb[i]);
    if (poison && l == 0) L.w.grad[3] = T(std::numeric_limits<float>::infinity());
    if (l > 0) {
      auto& din = dact[std::size_t(l)];
      din.assign(std::size_t(batch * L.in), 0.0f);
      for (int k = 0; k < batch; ++k)
        for (int i = 0; i < L.in; ++i) {
          if (act[std::size_t(l)][std::size_t(k * L.in + i)] <= 0.0f) continue;  // relu'
          float a = 0;
          for (int o = 0; o < L.out; ++o)
            a += dout[std::size_t(k * L.out + o)] * float(L.w.value[std::size_t(o * L.in + i)]);
          din[std::size_t(k * L.in + i)] = a;
        }
    }
  }
};

// One micro-step of an engine over the MLP: forward and backward inside the engine's module
// guards, then step(). The rank's micro-batch is samples [first, first + micro_batch).
template <class E, class T>
auto micro_step(E& e, Mlp<T>& m, std::int64_t first, int micro_batch, float* loss_out = nullptr) {
  std::vector<int> labels;
  m.load(first, micro_batch, labels);
  for (int l = 0; l < m.modules(); ++l) {
    auto g = e.forward(l);
    m.forward(l);
  }
  const float loss = m.loss(labels, e.loss_scale());
  if (loss_out) *loss_out = loss;
  for (int l = m.modules() - 1; l >= 0; --l) {
    auto g = e.backward(l);
    m.backward(l);
  }
  return e.step();
}

}  // namespace zp::test
