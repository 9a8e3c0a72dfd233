// examples/gpt.hpp: a GPT-2-style decoder-only transformer with hand-written forward and
// backward on the CPU, for zp_gpt and its tests. README "A GPT-style transformer" documents the
// architecture, the parameter names and layouts, the initialisation and the loss.
//
// Model<T, F> keeps its parameters as zp views of storage type T (float, zp::bf16, zp::fp16, or
// double for the gradient check) and computes in F (float, or double for the check). It is laid
// out for the tensor- and pipeline-parallel versions to come:
//  - every block's forward and backward is a free function over explicit buffers (input in,
//    output out; output gradient in, input gradient out) and the block's weights, so a pipeline
//    stage can run any range of blocks;
//  - the matrix products are two small functions over [in, out] weights (GPT-2's Conv1D layout),
//    which column- and row-parallel splits replace (c_attn and c_fc split by columns, the c_proj
//    weights by rows, as Megatron-LM does);
//  - the activations of a micro-batch live in an Activations object the caller owns, so several
//    micro-batches can be in flight.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "zp/error.hpp"
#include "zp/model.hpp"

namespace gpt {

struct Config {
  int vocab = 0, context = 32, d_model = 64, heads = 4, layers = 2;

  int head_dim() const { return d_model / heads; }
  void check() const {
    ZP_EXPECT(vocab > 0 && context > 0 && d_model > 0 && heads > 0 && layers > 0, "gpt: vocab ", vocab, ", context ",
              context, ", d_model ", d_model, ", heads ", heads, " and layers ", layers, " must all be positive");
    ZP_EXPECT(d_model % heads == 0, "gpt: d_model ", d_model, " is not a multiple of heads ", heads);
  }
};

// ---- kernels: the only places that loop over weights ----------------------------------------

// Sum of a[i] * b[i]: eight partial sums so the compiler vectorises it without -ffast-math.
template <class F>
F dot(const F* a, const F* b, int n) {
  F s[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  F t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) t += a[i] * b[i];
  return t;
}

// y = x W + b over `rows` rows; W is [in, out] row-major, b has `out` elements or is null.
// The inner loop runs along a row of W and of y, contiguous in both.
template <class F>
void matmul_forward(F* y, const F* x, const F* w, const F* b, int rows, int in, int out) {
  for (int n = 0; n < rows; ++n) {
    F* yn = y + std::size_t(n) * std::size_t(out);
    const F* xn = x + std::size_t(n) * std::size_t(in);
    for (int o = 0; o < out; ++o) yn[o] = b ? b[o] : F(0);
    for (int i = 0; i < in; ++i) {
      const F xi = xn[i];
      const F* wi = w + std::size_t(i) * std::size_t(out);
      for (int o = 0; o < out; ++o) yn[o] += xi * wi[o];
    }
  }
}

// The backward of matmul_forward: dx = dy W^T (overwritten; skipped when dx is null), and
// dW += x^T dy, db += the column sums of dy (db may be null).
template <class F>
void matmul_backward(F* dx, F* dw, F* db, const F* dy, const F* x, const F* w, int rows, int in, int out) {
  for (int n = 0; n < rows; ++n) {
    const F* dyn = dy + std::size_t(n) * std::size_t(out);
    const F* xn = x + std::size_t(n) * std::size_t(in);
    if (db)
      for (int o = 0; o < out; ++o) db[o] += dyn[o];
    for (int i = 0; i < in; ++i) {
      const F* wi = w + std::size_t(i) * std::size_t(out);
      F* dwi = dw + std::size_t(i) * std::size_t(out);
      const F xi = xn[i];
      for (int o = 0; o < out; ++o) dwi[o] += xi * dyn[o];
      if (dx) dx[std::size_t(n) * std::size_t(in) + std::size_t(i)] = dot(dyn, wi, out);
    }
  }
}

// y = (x - mean) / sqrt(var + 1e-5) * g + b per row of d elements (GPT-2's epsilon, biased
// variance); keeps mean and 1/std per row for the backward.
template <class F>
void layernorm_forward(F* y, F* mean, F* rstd, const F* x, const F* g, const F* b, int rows, int d) {
  for (int n = 0; n < rows; ++n) {
    const F* xn = x + std::size_t(n) * std::size_t(d);
    F* yn = y + std::size_t(n) * std::size_t(d);
    F m = 0, v = 0;
    for (int i = 0; i < d; ++i) m += xn[i];
    m /= F(d);
    for (int i = 0; i < d; ++i) v += (xn[i] - m) * (xn[i] - m);
    const F r = F(1) / std::sqrt(v / F(d) + F(1e-5));
    for (int i = 0; i < d; ++i) yn[i] = (xn[i] - m) * r * g[i] + b[i];
    mean[n] = m;
    rstd[n] = r;
  }
}

// dx = (1/std) (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) with dxhat = dy g; adds into dx
// (the residual stream's gradient is already there), dg and db.
template <class F>
void layernorm_backward(F* dx, F* dg, F* db, const F* dy, const F* x, const F* mean, const F* rstd, const F* g,
                        int rows, int d) {
  for (int n = 0; n < rows; ++n) {
    const F* xn = x + std::size_t(n) * std::size_t(d);
    const F* dyn = dy + std::size_t(n) * std::size_t(d);
    F* dxn = dx + std::size_t(n) * std::size_t(d);
    F s1 = 0, s2 = 0;
    for (int i = 0; i < d; ++i) {
      const F xhat = (xn[i] - mean[n]) * rstd[n], dxhat = dyn[i] * g[i];
      s1 += dxhat;
      s2 += dxhat * xhat;
      dg[i] += dyn[i] * xhat;
      db[i] += dyn[i];
    }
    s1 /= F(d);
    s2 /= F(d);
    for (int i = 0; i < d; ++i) {
      const F xhat = (xn[i] - mean[n]) * rstd[n];
      dxn[i] += rstd[n] * (dyn[i] * g[i] - s1 - xhat * s2);
    }
  }
}

// GELU, tanh approximation (as GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class F>
F gelu(F x) {
  const F k = F(std::sqrt(2.0 / std::numbers::pi));
  return F(0.5) * x * (F(1) + std::tanh(k * (x + F(0.044715) * x * x * x)));
}
template <class F>
F gelu_grad(F x) {
  const F k = F(std::sqrt(2.0 / std::numbers::pi));
  const F t = std::tanh(k * (x + F(0.044715) * x * x * x));
  return F(0.5) * (F(1) + t) + F(0.5) * x * (F(1) - t * t) * k * (F(1) + F(3 * 0.044715) * x * x);
}

// ---- one transformer block ----------------------------------------------------------------

// A block's tensors, in forward order; BlockWeights/BlockGrads index by these.
enum BlockTensor : int {
  ln_1_weight, ln_1_bias, c_attn_weight, c_attn_bias, attn_c_proj_weight, attn_c_proj_bias,
  ln_2_weight, ln_2_bias, c_fc_weight, c_fc_bias, mlp_c_proj_weight, mlp_c_proj_bias, block_tensors
};
inline constexpr const char* block_tensor_names[block_tensors] = {
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
inline std::array<std::size_t, block_tensors> block_tensor_sizes(const Config& c) {
  const std::size_t d = std::size_t(c.d_model);
  return {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d};
}
template <class F>
using BlockWeights = std::array<const F*, block_tensors>;
template <class F>
using BlockGrads = std::array<F*, block_tensors>;

// What a block's backward needs from its forward, for one micro-batch (rows = batch * context).
template <class F>
struct BlockActivations {
  std::vector<F> ln1, mean1, rstd1;  // ln_1's output [rows, d] and statistics [rows]
  std::vector<F> qkv;                // [rows, 3d]: q | k | v, head h in columns h*hd .. (h+1)*hd of each
  std::vector<F> att;                // softmax probabilities [batch, heads, context, context], 0 above the diagonal
  std::vector<F> heads;              // attention output before c_proj [rows, d]
  std::vector<F> mid;                // residual stream after attention [rows, d]
  std::vector<F> ln2, mean2, rstd2;
  std::vector<F> fc, act;            // c_fc's output before and after GELU [rows, 4d]

  void resize(const Config& c, int batch) {
    const std::size_t r = std::size_t(batch) * std::size_t(c.context), d = std::size_t(c.d_model);
    for (auto* v : {&ln1, &heads, &mid, &ln2}) v->resize(r * d);
    for (auto* v : {&mean1, &rstd1, &mean2, &rstd2}) v->resize(r);
    qkv.resize(r * 3 * d);
    att.resize(std::size_t(batch) * std::size_t(c.heads) * std::size_t(c.context) * std::size_t(c.context));
    fc.resize(r * 4 * d);
    act.resize(r * 4 * d);
  }
};

// y = x + attn(ln_1(x)); y = y + mlp(ln_2(y)), over `batch` sequences of c.context tokens.
template <class F>
void block_forward(const Config& c, int batch, const BlockWeights<F>& w, const F* x, F* y, BlockActivations<F>& a) {
  const int T = c.context, d = c.d_model, H = c.heads, hd = c.head_dim(), rows = batch * T;
  const F scale = F(1) / std::sqrt(F(hd));
  a.resize(c, batch);
  layernorm_forward(a.ln1.data(), a.mean1.data(), a.rstd1.data(), x, w[ln_1_weight], w[ln_1_bias], rows, d);
  matmul_forward(a.qkv.data(), a.ln1.data(), w[c_attn_weight], w[c_attn_bias], rows, d, 3 * d);
  std::vector<F> s(std::size_t(T), F(0));
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const F* q = a.qkv.data() + std::size_t(b * T + t) * std::size_t(3 * d) + std::size_t(h * hd);
        F* p = a.att.data() + (std::size_t(b * H + h) * std::size_t(T) + std::size_t(t)) * std::size_t(T);
        F mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {  // the causal mask: position t sees positions 0 .. t
          const F* k = a.qkv.data() + std::size_t(b * T + u) * std::size_t(3 * d) + std::size_t(d + h * hd);
          s[std::size_t(u)] = dot(q, k, hd) * scale;
          mx = std::max(mx, s[std::size_t(u)]);
        }
        F sum = 0;
        for (int u = 0; u <= t; ++u) sum += (p[u] = std::exp(s[std::size_t(u)] - mx));
        for (int u = 0; u < T; ++u) p[u] = u <= t ? p[u] / sum : F(0);
        F* o = a.heads.data() + std::size_t(b * T + t) * std::size_t(d) + std::size_t(h * hd);
        std::fill(o, o + hd, F(0));
        for (int u = 0; u <= t; ++u) {
          const F* v = a.qkv.data() + std::size_t(b * T + u) * std::size_t(3 * d) + std::size_t(2 * d + h * hd);
          for (int i = 0; i < hd; ++i) o[i] += p[u] * v[i];
        }
      }
  matmul_forward(a.mid.data(), a.heads.data(), w[attn_c_proj_weight], w[attn_c_proj_bias], rows, d, d);
  for (std::size_t i = 0; i < a.mid.size(); ++i) a.mid[i] += x[i];
  layernorm_forward(a.ln2.data(), a.mean2.data(), a.rstd2.data(), a.mid.data(), w[ln_2_weight], w[ln_2_bias], rows, d);
  matmul_forward(a.fc.data(), a.ln2.data(), w[c_fc_weight], w[c_fc_bias], rows, d, 4 * d);
  for (std::size_t i = 0; i < a.fc.size(); ++i) a.act[i] = gelu(a.fc[i]);
  matmul_forward(y, a.act.data(), w[mlp_c_proj_weight], w[mlp_c_proj_bias], rows, 4 * d, d);
  for (std::size_t i = 0; i < std::size_t(rows) * std::size_t(d); ++i) y[i] += a.mid[i];
}

// The backward of block_forward: from dy (d loss / d y) writes dx (d loss / d x) and adds the
// weight gradients into g. x is the block's input as the forward saw it.
template <class F>
void block_backward(const Config& c, int batch, const BlockWeights<F>& w, const BlockGrads<F>& g, const F* x,
                    const F* dy, F* dx, const BlockActivations<F>& a) {
  const int T = c.context, d = c.d_model, H = c.heads, hd = c.head_dim(), rows = batch * T;
  const std::size_t rd = std::size_t(rows) * std::size_t(d);
  const F scale = F(1) / std::sqrt(F(hd));
  // MLP: the residual passes dy through; c_proj, GELU, c_fc and ln_2 add the rest into dmid.
  std::vector<F> dmid(dy, dy + rd), dact(a.act.size()), dln(rd);
  matmul_backward(dact.data(), g[mlp_c_proj_weight], g[mlp_c_proj_bias], dy, a.act.data(), w[mlp_c_proj_weight], rows,
                  4 * d, d);
  for (std::size_t i = 0; i < dact.size(); ++i) dact[i] *= gelu_grad(a.fc[i]);
  matmul_backward(dln.data(), g[c_fc_weight], g[c_fc_bias], dact.data(), a.ln2.data(), w[c_fc_weight], rows, d, 4 * d);
  layernorm_backward(dmid.data(), g[ln_2_weight], g[ln_2_bias], dln.data(), a.mid.data(), a.mean2.data(),
                     a.rstd2.data(), w[ln_2_weight], rows, d);
  // Attention: the same with c_proj, the heads and c_attn; dx starts as the residual's dmid.
  std::vector<F> dheads(rd), dqkv(a.qkv.size(), F(0)), dp(static_cast<std::size_t>(T));
  matmul_backward(dheads.data(), g[attn_c_proj_weight], g[attn_c_proj_bias], dmid.data(), a.heads.data(),
                  w[attn_c_proj_weight], rows, d, d);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const std::size_t row = std::size_t(b * T + t) * std::size_t(3 * d);
        const F* p = a.att.data() + (std::size_t(b * H + h) * std::size_t(T) + std::size_t(t)) * std::size_t(T);
        const F* dout = dheads.data() + std::size_t(b * T + t) * std::size_t(d) + std::size_t(h * hd);
        F pdp = 0;  // sum_u p[u] dp[u], for the softmax backward
        for (int u = 0; u <= t; ++u) {
          const std::size_t ru = std::size_t(b * T + u) * std::size_t(3 * d);
          const F* v = a.qkv.data() + ru + std::size_t(2 * d + h * hd);
          F* dv = dqkv.data() + ru + std::size_t(2 * d + h * hd);
          dp[std::size_t(u)] = dot(dout, v, hd);
          pdp += p[u] * dp[std::size_t(u)];
          for (int i = 0; i < hd; ++i) dv[i] += p[u] * dout[i];
        }
        const F* q = a.qkv.data() + row + std::size_t(h * hd);
        F* dq = dqkv.data() + row + std::size_t(h * hd);
        for (int u = 0; u <= t; ++u) {
          const F ds = p[u] * (dp[std::size_t(u)] - pdp) * scale;  // through softmax and the 1/sqrt(hd)
          const std::size_t ru = std::size_t(b * T + u) * std::size_t(3 * d);
          const F* k = a.qkv.data() + ru + std::size_t(d + h * hd);
          F* dk = dqkv.data() + ru + std::size_t(d + h * hd);
          for (int i = 0; i < hd; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
  matmul_backward(dln.data(), g[c_attn_weight], g[c_attn_bias], dqkv.data(), a.ln1.data(), w[c_attn_weight], rows, d,
                  3 * d);
  std::copy(dmid.begin(), dmid.end(), dx);
  layernorm_backward(dx, g[ln_1_weight], g[ln_1_bias], dln.data(), x, a.mean1.data(), a.rstd1.data(), w[ln_1_weight],
                     rows, d);
}

// ---- the model ------------------------------------------------------------------------------

// One micro-batch in flight: its tokens, targets and everything backward needs. The caller
// owns it (a pipeline keeps one per micro-batch); Model::forward/loss/backward fill it.
template <class F>
struct Activations {
  int batch = 0;
  std::vector<int> tokens, targets;     // [batch, context]; targets[i] is the token after tokens[i]
  std::vector<std::vector<F>> x, dx;    // residual stream [layers + 1][rows, d] and d loss / d x
  std::vector<BlockActivations<F>> blocks;
  std::vector<F> lnf, meanf, rstdf;     // ln_f
  std::vector<F> logits, dlogits;       // [rows, vocab]

  Activations(const Config& c, int batch_) : batch(batch_) {
    c.check();
    ZP_EXPECT(batch > 0, "gpt: batch ", batch, " must be positive");
    const std::size_t r = std::size_t(batch) * std::size_t(c.context), d = std::size_t(c.d_model);
    tokens.assign(r, 0);
    targets.assign(r, 0);
    x.assign(std::size_t(c.layers + 1), std::vector<F>(r * d));
    dx = x;
    blocks.resize(std::size_t(c.layers));
    lnf.resize(r * d);
    meanf.resize(r);
    rstdf.resize(r);
    logits.resize(r * std::size_t(c.vocab));
    dlogits.resize(logits.size());
  }
  int rows(const Config& c) const { return batch * c.context; }
};

namespace detail {
// Storage type <-> compute type; zp's 16-bit types convert through float.
template <class F, class T>
F to_compute(T v) {
  if constexpr (std::is_floating_point_v<T>) return F(v);
  else return F(float(v));
}
template <class T, class F>
T to_storage(F v) {
  if constexpr (std::is_floating_point_v<T>) return T(v);
  else return T(float(v));
}
}  // namespace detail

// GPT-2's architecture with a separate (untied) LM head. Modules: 0 = wte and wpe, 1 .. layers =
// the blocks h.0 .. h.{layers-1}, layers + 1 = ln_f and lm_head.
template <class T, class F = float>
class Model {
 public:
  Model(const Config& c, std::uint64_t seed) : cfg_(c) {
    c.check();
    const std::size_t V = std::size_t(c.vocab), d = std::size_t(c.d_model);
    // Counter-based normals: element i of tensor k depends only on (seed, k, i), so a tensor-
    // parallel rank can initialise its slice alone and every run from a seed is the same.
    int k = 0;
    auto init = [&](zp::Param<T>& p, std::size_t n, double std_dev, double constant = 0) {
      p = zp::Param<T>(n);
      auto& v = init_.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i)
        v[i] = detail::to_storage<T>(std_dev == 0 ? constant : std_dev * normal(seed, std::uint64_t(k), i));
      p.value.rebind(v.data());
      ++k;
    };
    init_.reserve(std::size_t(2 + block_tensors * c.layers + 3));
    init(wte_, V * d, 0.02);
    init(wpe_, std::size_t(c.context) * d, 0.02);
    h_.resize(std::size_t(c.layers));
    const double proj = 0.02 / std::sqrt(2.0 * c.layers);  // GPT-2: residual projections scaled by 1/sqrt(2L)
    const auto sizes = block_tensor_sizes(c);
    for (auto& blk : h_)
      for (int t = 0; t < block_tensors; ++t) {
        const bool ln_gain = t == ln_1_weight || t == ln_2_weight, bias = t % 2 == 1;
        const double s = t == attn_c_proj_weight || t == mlp_c_proj_weight ? proj : 0.02;
        init(blk[std::size_t(t)], sizes[std::size_t(t)], ln_gain || bias ? 0.0 : s, ln_gain ? 1.0 : 0.0);
      }
    init(ln_f_weight_, d, 0.0, 1.0);
    init(ln_f_bias_, d, 0.0, 0.0);
    init(lm_head_, d * V, 0.02);
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Config& config() const { return cfg_; }
  int modules() const { return cfg_.layers + 2; }

  template <class V>
  friend void for_each_parameter(Model& m, V&& visit) {
    visit("wte.weight", 0, m.wte_);
    visit("wpe.weight", 0, m.wpe_);
    for (int l = 0; l < m.cfg_.layers; ++l)
      for (int t = 0; t < block_tensors; ++t)
        visit("h." + std::to_string(l) + "." + block_tensor_names[t], 1 + l, m.h_[std::size_t(l)][std::size_t(t)]);
    visit("ln_f.weight", m.cfg_.layers + 1, m.ln_f_weight_);
    visit("ln_f.bias", m.cfg_.layers + 1, m.ln_f_bias_);
    visit("lm_head.weight", m.cfg_.layers + 1, m.lm_head_);
  }

  // Module m's forward for the micro-batch in a (a.tokens set for module 0).
  void forward(int m, Activations<F>& a) {
    const Config& c = cfg_;
    const int rows = a.rows(c), d = c.d_model;
    load(m);
    if (m == 0) {
      for (int r = 0; r < rows; ++r) {
        const int tok = a.tokens[std::size_t(r)], pos = r % c.context;
        ZP_EXPECT(tok >= 0 && tok < c.vocab, "gpt: token ", tok, " at position ", r, " is outside the vocabulary of ",
                  c.vocab);
        for (int i = 0; i < d; ++i)
          a.x[0][std::size_t(r * d + i)] = wf_[0][std::size_t(tok * d + i)] + wf_[1][std::size_t(pos * d + i)];
      }
    } else if (m <= c.layers) {
      block_forward(c, a.batch, weights(), a.x[std::size_t(m - 1)].data(), a.x[std::size_t(m)].data(),
                    a.blocks[std::size_t(m - 1)]);
    } else {
      layernorm_forward(a.lnf.data(), a.meanf.data(), a.rstdf.data(), a.x[std::size_t(c.layers)].data(),
                        wf_[0].data(), wf_[1].data(), rows, d);
      matmul_forward(a.logits.data(), a.lnf.data(), wf_[2].data(), static_cast<const F*>(nullptr), rows, d, c.vocab);
    }
  }

  // Mean cross-entropy over every position of the micro-batch; seeds a.dlogits with
  // d(scale * loss)/d(logits) for backward.
  F loss(Activations<F>& a, float scale) {
    const int rows = a.rows(cfg_), V = cfg_.vocab;
    F total = 0;
    for (int r = 0; r < rows; ++r) {
      const F* z = a.logits.data() + std::size_t(r) * std::size_t(V);
      F* g = a.dlogits.data() + std::size_t(r) * std::size_t(V);
      const F mx = *std::max_element(z, z + V);
      F se = 0;
      for (int v = 0; v < V; ++v) se += (g[v] = std::exp(z[v] - mx));
      const int t = a.targets[std::size_t(r)];
      ZP_EXPECT(t >= 0 && t < V, "gpt: target ", t, " at position ", r, " is outside the vocabulary of ", V);
      total += std::log(se) + mx - z[t];
      for (int v = 0; v < V; ++v) g[v] = (g[v] / se - (v == t ? F(1) : F(0))) * F(scale) / F(rows);
    }
    return total / F(rows);
  }

  // Module m's backward: adds its parameters' gradients into their grad views (zp's rule) and,
  // for m > 0, writes a.dx[m - 1].
  void backward(int m, Activations<F>& a) {
    const Config& c = cfg_;
    const int rows = a.rows(c), d = c.d_model;
    load(m);
    auto ps = params(m);
    gf_.resize(ps.size());
    for (std::size_t k = 0; k < ps.size(); ++k) gf_[k].assign(ps[k]->size(), F(0));
    if (m == 0) {
      for (int r = 0; r < rows; ++r) {
        const int tok = a.tokens[std::size_t(r)], pos = r % c.context;
        for (int i = 0; i < d; ++i) {
          const F g = a.dx[0][std::size_t(r * d + i)];
          gf_[0][std::size_t(tok * d + i)] += g;
          gf_[1][std::size_t(pos * d + i)] += g;
        }
      }
    } else if (m <= c.layers) {
      BlockGrads<F> g;
      for (int t = 0; t < block_tensors; ++t) g[std::size_t(t)] = gf_[std::size_t(t)].data();
      block_backward(c, a.batch, weights(), g, a.x[std::size_t(m - 1)].data(), a.dx[std::size_t(m)].data(),
                     a.dx[std::size_t(m - 1)].data(), a.blocks[std::size_t(m - 1)]);
    } else {
      std::vector<F> dln(std::size_t(rows) * std::size_t(d));
      matmul_backward(dln.data(), gf_[2].data(), static_cast<F*>(nullptr), a.dlogits.data(), a.lnf.data(),
                      wf_[2].data(), rows, d, c.vocab);
      auto& dx = a.dx[std::size_t(c.layers)];
      std::fill(dx.begin(), dx.end(), F(0));
      layernorm_backward(dx.data(), gf_[0].data(), gf_[1].data(), dln.data(), a.x[std::size_t(c.layers)].data(),
                         a.meanf.data(), a.rstdf.data(), wf_[0].data(), rows, d);
    }
    for (std::size_t k = 0; k < ps.size(); ++k) {
      zp::View<T>& gv = ps[k]->grad;
      for (std::size_t i = 0; i < gv.size(); ++i)
        gv[i] = detail::to_storage<T>(detail::to_compute<F>(gv[i]) + gf_[k][i]);
    }
  }

 private:
  // A standard normal from (seed, tensor, index): splitmix64 and Box-Muller, the same on every
  // platform (std::normal_distribution is not).
  static double normal(std::uint64_t seed, std::uint64_t tensor, std::uint64_t i) {
    auto mix = [](std::uint64_t x) {
      x += 0x9e3779b97f4a7c15ull;
      x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
      x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
      return x ^ (x >> 31);
    };
    const std::uint64_t base = mix(mix(seed) ^ (tensor * 0xd1b54a32d192ed03ull)) ^ (i * 2 * 0x9e3779b97f4a7c15ull);
    const double u1 = (double(mix(base) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: the log stays finite
    const double u2 = double(mix(base + 1) >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

  std::vector<zp::Param<T>*> params(int m) {
    if (m == 0) return {&wte_, &wpe_};
    if (m <= cfg_.layers) {
      std::vector<zp::Param<T>*> ps;
      for (auto& p : h_[std::size_t(m - 1)]) ps.push_back(&p);
      return ps;
    }
    return {&ln_f_weight_, &ln_f_bias_, &lm_head_};
  }

  // Module m's parameters in the compute type, into wf_ (one vector per tensor).
  void load(int m) {
    ZP_EXPECT(m >= 0 && m < modules(), "gpt: module ", m, " is not in [0, ", modules(), ")");
    auto ps = params(m);
    wf_.resize(ps.size());
    for (std::size_t k = 0; k < ps.size(); ++k) {
      const zp::View<T>& v = ps[k]->value;
      wf_[k].resize(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) wf_[k][i] = detail::to_compute<F>(v[i]);
    }
  }
  BlockWeights<F> weights() const {
    BlockWeights<F> w;
    for (int t = 0; t < block_tensors; ++t) w[std::size_t(t)] = wf_[std::size_t(t)].data();
    return w;
  }

  Config cfg_;
  zp::Param<T> wte_, wpe_;
  std::vector<std::array<zp::Param<T>, block_tensors>> h_;
  zp::Param<T> ln_f_weight_, ln_f_bias_, lm_head_;
  std::vector<std::vector<T>> init_;      // initial values until zp rebinds the views
  std::vector<std::vector<F>> wf_, gf_;   // the current module's weights and gradients in F
};

}  // namespace gpt
