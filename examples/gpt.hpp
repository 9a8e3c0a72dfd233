// examples/gpt.hpp: a GPT-2-style decoder-only transformer with hand-written forward and
// backward on the CPU, for zp_gpt and its tests. README "A GPT-style transformer" documents the
// architecture, the parameter names and layouts, the initialisation and the loss.
//
// Model<T, F> keeps its parameters as zp views of storage type T (float, zp::bf16, zp::fp16, or
// double for the gradient check) and computes in F (float, or double for the check). One Model
// is one rank's part of the network under any DP x TP x PP grid:
//  - every block's forward and backward is a free function over explicit buffers (input in,
//    output out; output gradient in, input gradient out), so a pipeline stage runs any range of
//    modules (pipeline_stage());
//  - the matrix products are split as Megatron-LM splits them (c_attn and c_fc by columns, the
//    c_proj weights by rows, the vocabulary of wte and lm_head), their communication from
//    zp/tensor_parallel.hpp;
//  - the activations of a micro-batch live in an Activations object the caller owns, so several
//    micro-batches can be in flight (train_step() keeps one per pipeline slot).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/engine.hpp"
#include "zp/error.hpp"
#include "zp/model.hpp"
#include "zp/pipeline.hpp"
#include "zp/tensor_parallel.hpp"

namespace gpt {

struct Config {
  int vocab = 0, context = 32, d_model = 64, heads = 4, layers = 2;

  int head_dim() const { return d_model / heads; }
  void check() const {
    ZP_EXPECT(vocab > 0 && context > 0 && d_model > 0 && heads > 0 && layers > 0, "gpt: vocab ",
              vocab, ", context ", context, ", d_model ", d_model, ", heads ", heads,
              " and layers ", layers, " must all be positive");
    ZP_EXPECT(d_model % heads == 0, "gpt: d_model ", d_model, " is not a multiple of heads ",
              heads);
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

// The matmuls take rows (tokens) matmul_rows at a time and columns matmul_cols at a time, so a
// weight is read from memory once per matmul_rows rows instead of once per row, and the block of
// outputs it updates stays in L1. Each output element still adds its terms in the same order (the
// shared index ascending, rows ascending), so the results are bitwise those of one row at a time
// (tests/gpt.test.cpp checks them against that loop; zp_bench_gpt times both).
inline constexpr int matmul_rows = 8, matmul_cols = 256;

// The index of element (r, c) of a row-major matrix `width` elements wide.
inline std::size_t row_major(int r, int c, int width) {
  return std::size_t(r) * std::size_t(width) + std::size_t(c);
}

// y = x W + b over `rows` rows; W is [in, out] row-major, b has `out` elements or is null.
template <class F>
void matmul_forward(F* y, const F* x, const F* w, const F* b, int rows, int in, int out) {
  for (int n0 = 0; n0 < rows; n0 += matmul_rows) {
    const int nr = std::min(matmul_rows, rows - n0);
    for (int o0 = 0; o0 < out; o0 += matmul_cols) {
      const int no = std::min(matmul_cols, out - o0);
      for (int r = 0; r < nr; ++r)
        for (int o = 0; o < no; ++o) y[row_major(n0 + r, o0 + o, out)] = b ? b[o0 + o] : F(0);
      for (int i = 0; i < in; ++i) {
        const F* wi = w + row_major(i, o0, out);
        for (int r = 0; r < nr; ++r) {
          const F xi = x[row_major(n0 + r, i, in)];
          F* yr = y + row_major(n0 + r, o0, out);
          for (int o = 0; o < no; ++o) yr[o] += xi * wi[o];
        }
      }
    }
  }
}

// The backward of matmul_forward: dx = dy W^T (overwritten; skipped when dx is null), and
// dW += x^T dy, db += the column sums of dy (db may be null).
template <class F>
void matmul_backward(F* dx, F* dw, F* db, const F* dy, const F* x, const F* w, int rows, int in,
                     int out) {
  for (int n0 = 0; n0 < rows; n0 += matmul_rows) {
    const int nr = std::min(matmul_rows, rows - n0);
    if (db)
      for (int r = 0; r < nr; ++r)
        for (int o = 0; o < out; ++o) db[o] += dy[row_major(n0 + r, o, out)];
    for (int o0 = 0; o0 < out; o0 += matmul_cols) {
      const int no = std::min(matmul_cols, out - o0);
      for (int i = 0; i < in; ++i) {
        F* dwi = dw + row_major(i, o0, out);
        for (int r = 0; r < nr; ++r) {
          const F xi = x[row_major(n0 + r, i, in)];
          const F* dyr = dy + row_major(n0 + r, o0, out);
          for (int o = 0; o < no; ++o) dwi[o] += xi * dyr[o];
        }
      }
    }
    if (dx)
      for (int i = 0; i < in; ++i)
        for (int r = 0; r < nr; ++r)
          dx[row_major(n0 + r, i, in)] =
              dot(dy + row_major(n0 + r, 0, out), w + row_major(i, 0, out), out);
  }
}

// y = (x - mean) / sqrt(var + 1e-5) * g + b per row of d elements (GPT-2's epsilon, biased
// variance); keeps mean and 1/std per row for the backward.
template <class F>
void layernorm_forward(F* y, F* mean, F* rstd, const F* x, const F* g, const F* b, int rows,
                       int d) {
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
void layernorm_backward(F* dx, F* dg, F* db, const F* dy, const F* x, const F* mean, const F* rstd,
                        const F* g, int rows, int d) {
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
  ln_1_weight,
  ln_1_bias,
  c_attn_weight,
  c_attn_bias,
  attn_c_proj_weight,
  attn_c_proj_bias,
  ln_2_weight,
  ln_2_bias,
  c_fc_weight,
  c_fc_bias,
  mlp_c_proj_weight,
  mlp_c_proj_bias,
  block_tensors
};
inline constexpr const char* block_tensor_names[block_tensors] = {
    "ln_1.weight",        "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
    "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

// A block's widths on one tensor-parallel rank (Megatron's split): `heads` of the config's heads
// (c_attn's columns and attn.c_proj's rows for them) and `ff` of the MLP's 4d columns (c_fc's
// columns, mlp.c_proj's rows). Without tensor parallelism: all of them.
struct BlockShape {
  int d = 0, heads = 0, head_dim = 0, ff = 0;
  int width() const { return heads * head_dim; }  // this rank's q (or k, or v) columns
};
inline std::array<std::size_t, block_tensors> block_tensor_sizes(const BlockShape& s) {
  const std::size_t d = std::size_t(s.d), w = std::size_t(s.width()), f = std::size_t(s.ff);
  return {d, d, d * 3 * w, 3 * w, w * d, d, d, d, d * f, f, f * d, d};
}
template <class F>
using BlockWeights = std::array<const F*, block_tensors>;
template <class F>
using BlockGrads = std::array<F*, block_tensors>;

// What a block's backward needs from its forward, for one micro-batch (rows = batch * context).
template <class F>
struct BlockActivations {
  std::vector<F> ln1, mean1, rstd1;  // ln_1's output [rows, d] and statistics [rows]
  std::vector<F> qkv;  // [rows, 3w]: q | k | v, local head h in columns h*hd .. (h+1)*hd of each
  std::vector<F>
      att;  // softmax probabilities [batch, heads, context, context], 0 above the diagonal
  std::vector<F> heads;  // attention output before c_proj [rows, w]
  std::vector<F> mid;    // residual stream after attention [rows, d]
  std::vector<F> ln2, mean2, rstd2;
  std::vector<F> fc, act;  // c_fc's output before and after GELU [rows, ff]

  void resize(const BlockShape& s, int context, int batch) {
    const std::size_t r = std::size_t(batch) * std::size_t(context), d = std::size_t(s.d),
                      w = std::size_t(s.width());
    for (auto* v : {&ln1, &mid, &ln2}) v->resize(r * d);
    for (auto* v : {&mean1, &rstd1, &mean2, &rstd2}) v->resize(r);
    heads.resize(r * w);
    qkv.resize(r * 3 * w);
    att.resize(std::size_t(batch) * std::size_t(s.heads) * std::size_t(context) *
               std::size_t(context));
    fc.resize(r * std::size_t(s.ff));
    act.resize(r * std::size_t(s.ff));
  }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto* v :
         {&ln1, &mean1, &rstd1, &qkv, &att, &heads, &mid, &ln2, &mean2, &rstd2, &fc, &act})
      n += v->size();
    return n * sizeof(F);
  }
};

// y = x + attn(ln_1(x)); y = y + mlp(ln_2(y)), over `batch` sequences of `context` tokens. c_attn
// and c_fc are column-parallel, the two c_proj row-parallel: their partial outputs are summed
// over the tensor-parallel group `tp` before the (replicated) bias is added.
template <class F>
void block_forward(const BlockShape& s, int context, int batch, const BlockWeights<F>& w,
                   const F* x, F* y, BlockActivations<F>& a, const zp::tp::Group<F>& tp) {
  const int T = context, d = s.d, H = s.heads, hd = s.head_dim, W = s.width(), rows = batch * T;
  const std::size_t rd = std::size_t(rows) * std::size_t(d);
  const F scale = F(1) / std::sqrt(F(hd));
  a.resize(s, context, batch);
  layernorm_forward(a.ln1.data(), a.mean1.data(), a.rstd1.data(), x, w[ln_1_weight], w[ln_1_bias],
                    rows, d);
  matmul_forward(a.qkv.data(), a.ln1.data(), w[c_attn_weight], w[c_attn_bias], rows, d, 3 * W);
  std::vector<F> sc(std::size_t(T), F(0));
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const F* q =
            a.qkv.data() + std::size_t(b * T + t) * std::size_t(3 * W) + std::size_t(h * hd);
        F* p = a.att.data() +
               (std::size_t(b * H + h) * std::size_t(T) + std::size_t(t)) * std::size_t(T);
        F mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {  // the causal mask: position t sees positions 0 .. t
          const F* k =
              a.qkv.data() + std::size_t(b * T + u) * std::size_t(3 * W) + std::size_t(W + h * hd);
          sc[std::size_t(u)] = dot(q, k, hd) * scale;
          mx = std::max(mx, sc[std::size_t(u)]);
        }
        F sum = 0;
        for (int u = 0; u <= t; ++u) sum += (p[u] = std::exp(sc[std::size_t(u)] - mx));
        for (int u = 0; u < T; ++u) p[u] = u <= t ? p[u] / sum : F(0);
        F* o = a.heads.data() + std::size_t(b * T + t) * std::size_t(W) + std::size_t(h * hd);
        std::fill(o, o + hd, F(0));
        for (int u = 0; u <= t; ++u) {
          const F* v = a.qkv.data() + std::size_t(b * T + u) * std::size_t(3 * W) +
                       std::size_t(2 * W + h * hd);
          for (int i = 0; i < hd; ++i) o[i] += p[u] * v[i];
        }
      }
  matmul_forward(a.mid.data(), a.heads.data(), w[attn_c_proj_weight],
                 static_cast<const F*>(nullptr), rows, W, d);
  tp.all_reduce(std::span<F>(a.mid));
  for (std::size_t i = 0; i < rd; ++i) a.mid[i] += w[attn_c_proj_bias][i % std::size_t(d)] + x[i];
  layernorm_forward(a.ln2.data(), a.mean2.data(), a.rstd2.data(), a.mid.data(), w[ln_2_weight],
                    w[ln_2_bias], rows, d);
  matmul_forward(a.fc.data(), a.ln2.data(), w[c_fc_weight], w[c_fc_bias], rows, d, s.ff);
  for (std::size_t i = 0; i < a.fc.size(); ++i) a.act[i] = gelu(a.fc[i]);
  matmul_forward(y, a.act.data(), w[mlp_c_proj_weight], static_cast<const F*>(nullptr), rows, s.ff,
                 d);
  tp.all_reduce(std::span<F>(y, rd));
  for (std::size_t i = 0; i < rd; ++i) y[i] += w[mlp_c_proj_bias][i % std::size_t(d)] + a.mid[i];
}

// The backward of block_forward: from dy (d loss / d y) writes dx (d loss / d x) and adds the
// weight gradients into g. x is the block's input as the forward saw it. The input gradients of
// the two column-parallel products are summed over `tp`; everything else is local.
template <class F>
void block_backward(const BlockShape& s, int context, int batch, const BlockWeights<F>& w,
                    const BlockGrads<F>& g, const F* x, const F* dy, F* dx,
                    const BlockActivations<F>& a, const zp::tp::Group<F>& tp) {
  const int T = context, d = s.d, H = s.heads, hd = s.head_dim, W = s.width(), rows = batch * T;
  const std::size_t rd = std::size_t(rows) * std::size_t(d);
  const F scale = F(1) / std::sqrt(F(hd));
  // MLP: the residual passes dy through; c_proj, GELU, c_fc and ln_2 add the rest into dmid.
  std::vector<F> dmid(dy, dy + rd), dact(a.act.size()), dln(rd);
  matmul_backward(dact.data(), g[mlp_c_proj_weight], g[mlp_c_proj_bias], dy, a.act.data(),
                  w[mlp_c_proj_weight], rows, s.ff, d);
  for (std::size_t i = 0; i < dact.size(); ++i) dact[i] *= gelu_grad(a.fc[i]);
  matmul_backward(dln.data(), g[c_fc_weight], g[c_fc_bias], dact.data(), a.ln2.data(),
                  w[c_fc_weight], rows, d, s.ff);
  tp.all_reduce(std::span<F>(dln));
  layernorm_backward(dmid.data(), g[ln_2_weight], g[ln_2_bias], dln.data(), a.mid.data(),
                     a.mean2.data(), a.rstd2.data(), w[ln_2_weight], rows, d);
  // Attention: the same with c_proj, the heads and c_attn; dx starts as the residual's dmid.
  std::vector<F> dheads(std::size_t(rows) * std::size_t(W)), dqkv(a.qkv.size(), F(0)),
      dp(static_cast<std::size_t>(T));
  matmul_backward(dheads.data(), g[attn_c_proj_weight], g[attn_c_proj_bias], dmid.data(),
                  a.heads.data(), w[attn_c_proj_weight], rows, W, d);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const std::size_t row = std::size_t(b * T + t) * std::size_t(3 * W);
        const F* p = a.att.data() +
                     (std::size_t(b * H + h) * std::size_t(T) + std::size_t(t)) * std::size_t(T);
        const F* dout =
            dheads.data() + std::size_t(b * T + t) * std::size_t(W) + std::size_t(h * hd);
        F pdp = 0;  // sum_u p[u] dp[u], for the softmax backward
        for (int u = 0; u <= t; ++u) {
          const std::size_t ru = std::size_t(b * T + u) * std::size_t(3 * W);
          const F* v = a.qkv.data() + ru + std::size_t(2 * W + h * hd);
          F* dv = dqkv.data() + ru + std::size_t(2 * W + h * hd);
          dp[std::size_t(u)] = dot(dout, v, hd);
          pdp += p[u] * dp[std::size_t(u)];
          for (int i = 0; i < hd; ++i) dv[i] += p[u] * dout[i];
        }
        const F* q = a.qkv.data() + row + std::size_t(h * hd);
        F* dq = dqkv.data() + row + std::size_t(h * hd);
        for (int u = 0; u <= t; ++u) {
          const F ds =
              p[u] * (dp[std::size_t(u)] - pdp) * scale;  // through softmax and the 1/sqrt(hd)
          const std::size_t ru = std::size_t(b * T + u) * std::size_t(3 * W);
          const F* k = a.qkv.data() + ru + std::size_t(W + h * hd);
          F* dk = dqkv.data() + ru + std::size_t(W + h * hd);
          for (int i = 0; i < hd; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
  matmul_backward(dln.data(), g[c_attn_weight], g[c_attn_bias], dqkv.data(), a.ln1.data(),
                  w[c_attn_weight], rows, d, 3 * W);
  tp.all_reduce(std::span<F>(dln));
  std::copy(dmid.begin(), dmid.end(), dx);
  layernorm_backward(dx, g[ln_1_weight], g[ln_1_bias], dln.data(), x, a.mean1.data(),
                     a.rstd1.data(), w[ln_1_weight], rows, d);
}

// ---- the model ------------------------------------------------------------------------------

// GPT-2's weight decay practice (nanoGPT's, Megatron-LM's): the matrices decay (the embeddings,
// c_attn, the c_projs, c_fc, lm_head), the biases and the layer norms' gains do not; for
// zp::EngineConfig::weight_decay_filter.
inline bool is_matrix(std::string_view name) {
  return name.ends_with(".weight") && name.find("ln_") == std::string_view::npos;
}

// One micro-batch in flight: its tokens, targets and everything backward needs. The caller
// owns it (a pipeline keeps one per micro-batch in flight); Model::forward/loss/backward fill it.
// With `recompute` (activation checkpointing, one checkpoint a block, as Megatron-LM's full
// recomputation and llm.c's): a block keeps only its input, the residual stream x, and its
// backward runs its forward again into one BlockActivations all blocks share. Memory: that one
// set instead of one a block; time: one more forward of every block; results: bitwise the same
// (the same code on the same inputs and weights). The last block a forward ran still has its
// set, so its backward, the first, runs no forward again.
template <class F>
struct Activations {
  int batch = 0;
  bool recompute = false;
  int held = -1;  // with `recompute`: the layer whose activations the shared set holds
  std::vector<int> tokens, targets;   // [batch, context]; targets[i] is the token after tokens[i],
                                      // or zp::tp::ignore_index to leave position i out of the loss
  std::vector<std::vector<F>> x, dx;  // residual stream [layers + 1][rows, d] and d loss / d x
  std::vector<BlockActivations<F>> blocks;  // one a layer, or the one shared with `recompute`
  std::vector<F> y;                         // with `recompute`: a block's output, computed again
  std::vector<F> lnf, meanf, rstdf;         // ln_f
  std::vector<F> logits, dlogits;           // [rows, this rank's vocabulary columns]

  Activations(const Config& c, int batch_, bool recompute_ = false)
      : batch(batch_), recompute(recompute_) {
    c.check();
    ZP_EXPECT(batch > 0, "gpt: batch ", batch, " must be positive");
    const std::size_t r = std::size_t(batch) * std::size_t(c.context), d = std::size_t(c.d_model);
    tokens.assign(r, 0);
    targets.assign(r, 0);
    x.assign(std::size_t(c.layers + 1), std::vector<F>(r * d));
    dx = x;
    blocks.resize(recompute ? 1 : std::size_t(c.layers));
    if (recompute) y.resize(r * d);
    lnf.resize(r * d);
    meanf.resize(r);
    rstdf.resize(r);
  }
  int rows(const Config& c) const { return batch * c.context; }
  // What block `layer` (0-based) saves for its backward.
  BlockActivations<F>& block(int layer) { return blocks[recompute ? 0 : std::size_t(layer)]; }
  // The bytes this set holds (the blocks' parts once they ran).
  std::size_t bytes() const {
    std::size_t n = (tokens.size() + targets.size()) * sizeof(int);
    for (const auto* vs : {&x, &dx})
      for (const auto& v : *vs) n += v.size() * sizeof(F);
    for (const auto& b : blocks) n += b.bytes();
    for (const auto* v : {&y, &lnf, &meanf, &rstdf, &logits, &dlogits}) n += v->size() * sizeof(F);
    return n;
  }
};

namespace detail {
// Storage type <-> compute type; zp's 16-bit types convert through float.
template <class F, class T>
F to_compute(T v) {
  if constexpr (std::is_floating_point_v<T>)
    return F(v);
  else
    return F(float(v));
}
template <class T, class F>
T to_storage(F v) {
  if constexpr (std::is_floating_point_v<T>)
    return T(v);
  else
    return T(float(v));
}
}  // namespace detail

// One rank's part of a [rows, cols] row-major matrix (vectors are [1, n]): rows `row`, and in
// each of `parts` equal column blocks (c_attn's q, k and v) the columns `col` of that block, as
// zp sees it (a vector's shape is 1-D; the blocks are a dimension of their own).
inline zp::Placement part_of(std::size_t rows, std::size_t cols, zp::tp::Range row,
                             zp::tp::Range col, std::size_t parts = 1) {
  zp::Placement p;
  if (rows > 1) p.shape = {rows}, p.begin = {row.begin}, p.end = {row.end};
  if (parts > 1) p.shape.push_back(parts), p.begin.push_back(0), p.end.push_back(parts);
  p.shape.push_back(cols / parts), p.begin.push_back(col.begin), p.end.push_back(col.end);
  return p;
}

// GPT-2's architecture with a separate (untied) LM head. Modules: 0 = wte and wpe, 1 .. layers =
// the blocks h.0 .. h.{layers-1}, layers + 1 = ln_f and lm_head.
//
// One rank holds one part of it: the modules [first, end) of a pipeline stage (pipeline_stage()),
// each split over the tensor-parallel group `tp` as Megatron-LM does: wte by vocabulary rows,
// c_attn by heads (columns), c_fc by columns, the two c_proj by the matching rows, lm_head by
// vocabulary columns; layer norms, wpe and the c_proj biases are replicated. Tensors keep their
// full model's names; a zp::Placement says where each rank's part sits. The default is the whole
// model.
template <class T, class F = float>
class Model {
 public:
  struct Modules {
    int first = 0, end = -1;  // -1: through the last module
  };
  // held: the model holds its initial values (its views point at them) until
  // release_initial_values(); on_request: it holds none (its value views unbound) and an engine
  // asks initializer() for the elements each rank keeps (ZeRO-Init).
  enum class InitialValues { held, on_request };

  Model(const Config& c, std::uint64_t seed, zp::tp::Group<F> tp = {}, Modules modules = {},
        InitialValues values = InitialValues::held)
      : cfg_(c), tp_(std::move(tp)), seed_(seed) {
    c.check();
    const int P = tp_.size(), r = tp_.rank();
    first_ = modules.first;
    end_ = modules.end < 0 ? c.layers + 2 : modules.end;
    ZP_EXPECT(0 <= first_ && first_ < end_ && end_ <= c.layers + 2, "gpt: modules [", modules.first,
              ", ", modules.end, ") are not a non-empty range of the model's ", c.layers + 2,
              " modules");
    ZP_EXPECT(c.heads % P == 0, "gpt: heads ", c.heads, " do not split over ", P,
              " tensor-parallel ranks");
    ZP_EXPECT(c.vocab >= P, "gpt: the vocabulary of ", c.vocab, " is smaller than the ", P,
              " tensor-parallel ranks");
    const std::size_t V = std::size_t(c.vocab), d = std::size_t(c.d_model),
                      hd = std::size_t(c.head_dim());
    vocab_ = zp::tp::split(V, P, r);
    const zp::tp::Range heads = zp::tp::split(std::size_t(c.heads), P, r),
                        ff = zp::tp::split(4 * d, P, r);
    shape_ = {c.d_model, int(heads.size()), c.head_dim(), int(ff.size())};
    const zp::tp::Range width{heads.begin * hd, heads.end * hd};

    // Tensors in the full model's order, k = 0, 1, ... (initial_value()).
    int k = 0;
    // A tensor of [rows, cols], this rank's part of it (part_of), its initial values.
    auto add = [&](int module, std::string name, std::size_t rows, std::size_t cols,
                   const zp::Placement& place, double std_dev, double constant = 0) {
      const int tensor = k++;
      if (module < first_ || module >= end_) return;
      Tensor& t = tensors_.emplace_back();
      t.name = std::move(name);
      t.module = module;
      t.rows = rows;
      t.cols = cols;
      t.place = place;
      t.index = tensor;
      t.std_dev = std_dev;
      t.constant = constant;
      t.param = zp::Param<T>(place.size());
      if (values == InitialValues::on_request) return;
      t.init.resize(place.size());
      for (std::size_t i = 0; i < place.size(); ++i)
        t.init[i] = detail::to_storage<T>(initial_value(t, i));
    };
    // A whole tensor (replicated over the TP group).
    auto add_whole = [&](int module, std::string name, std::size_t rows, std::size_t cols,
                         double std_dev, double constant = 0) {
      add(module, std::move(name), rows, cols, part_of(rows, cols, {0, rows}, {0, cols}), std_dev,
          constant);
    };
    const std::size_t C = std::size_t(c.context), D4 = 4 * d;
    add(0, "wte.weight", V, d, part_of(V, d, vocab_, {0, d}), 0.02);
    add_whole(0, "wpe.weight", C, d, 0.02);
    const double proj =
        0.02 / std::sqrt(2.0 * c.layers);  // GPT-2: residual projections scaled by 1/sqrt(2L)
    for (int l = 0; l < c.layers; ++l) {
      const std::string h = "h." + std::to_string(l) + ".";
      // Column-parallel c_attn (by heads, inside each of q, k, v) and c_fc; row-parallel c_proj.
      auto split_t = [&](int t, std::size_t rows, std::size_t cols, double sd) {
        const std::string n = h + block_tensor_names[t];
        if (t == c_attn_weight || t == c_attn_bias)
          add(1 + l, n, rows, cols, part_of(rows, cols, {0, rows}, width, 3), sd);
        else if (t == c_fc_weight || t == c_fc_bias)
          add(1 + l, n, rows, cols, part_of(rows, cols, {0, rows}, ff), sd);
        else
          add(1 + l, n, rows, cols,
              part_of(rows, cols, t == attn_c_proj_weight ? width : ff, {0, d}), sd);
      };
      for (int t = 0; t < block_tensors; ++t) {
        const std::string n = h + block_tensor_names[t];
        const double sd = t == attn_c_proj_weight || t == mlp_c_proj_weight ? proj : 0.02;
        switch (t) {
          case ln_1_weight:
          case ln_2_weight: add_whole(1 + l, n, 1, d, 0.0, 1.0); break;
          case c_attn_weight: split_t(t, d, 3 * d, sd); break;
          case c_attn_bias: split_t(t, 1, 3 * d, 0.0); break;
          case attn_c_proj_weight: split_t(t, d, d, sd); break;
          case c_fc_weight: split_t(t, d, D4, sd); break;
          case c_fc_bias: split_t(t, 1, D4, 0.0); break;
          case mlp_c_proj_weight: split_t(t, D4, d, sd); break;
          default: add_whole(1 + l, n, 1, d, 0.0); break;  // the other biases, layer norm shifts
        }
      }
    }
    add_whole(c.layers + 1, "ln_f.weight", 1, d, 0.0, 1.0);
    add_whole(c.layers + 1, "ln_f.bias", 1, d, 0.0, 0.0);
    add(c.layers + 1, "lm_head.weight", d, V, part_of(d, V, {0, d}, vocab_), 0.02);
    if (values == InitialValues::held)
      for (Tensor& t : tensors_) t.param.value.rebind(t.init.data());
    for (int m = first_; m < end_; ++m) {
      module_begin_.push_back(0);
      while (module_begin_.back() < tensors_.size() && tensors_[module_begin_.back()].module < m)
        ++module_begin_.back();
    }
    module_begin_.push_back(tensors_.size());
    for (int m = first_; m < end_; ++m) {
      const auto [first, end] = module_tensors(m);
      std::size_t n = 0;
      for (std::size_t t = first; t < end; ++t) n += tensors_[t].place.size();
      largest_ = std::max(largest_, n);
    }
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Config& config() const { return cfg_; }
  int modules() const { return cfg_.layers + 2; }  // of the whole model
  int first_module() const { return first_; }      // this rank's modules: [first, end)
  int end_module() const { return end_; }
  bool has_loss() const { return end_ == modules(); }
  const BlockShape& block_shape() const { return shape_; }
  zp::tp::Range vocab() const { return vocab_; }  // this rank's rows of wte and columns of lm_head
  // Every module and the whole vocabulary on this rank (no tensor or pipeline split).
  bool whole() const {
    return first_ == 0 && has_loss() && vocab_.size() == std::size_t(cfg_.vocab);
  }

  // This rank's tensors in forward order: name, module, where the part sits, and the views.
  struct Tensor {
    std::string name;
    int module = 0;
    std::size_t rows = 1, cols = 0;  // the full tensor as a matrix (Hugging Face's, but lm_head's
                                     // [d, V] is nn.Linear's transpose)
    zp::Placement place;             // this rank's part of it (split unless it is the whole)
    zp::Param<T> param;
    std::vector<T> init;  // initial values until an engine takes them (release_initial_values)
    int index = 0;        // in the full model's order: its draws' stream
    double std_dev = 0, constant = 0;  // N(0, std_dev), or `constant` where std_dev is 0
  };
  const std::vector<Tensor>& tensors() const { return tensors_; }
  // Frees the initial values once an engine took them and rebound the views into its memory (or,
  // stage 3, to nothing): a copy of this rank's part of the model that training never reads.
  void release_initial_values() {
    for (Tensor& t : tensors_) {
      ZP_EXPECT(t.init.empty() || t.param.value.data() != t.init.data(), "gpt: '", t.name,
                "' still reads its initial values; free them after the engine took them");
      std::vector<T>().swap(t.init);
    }
  }

  // The initial values of this rank's tensors, as zp::EngineConfig::initializer: elements
  // [first, first + out.size()) of this rank's part of tensor `name`, the values a held model
  // holds (the engine rounds them to T as from there). Valid while the model lives.
  zp::Initializer initializer() const {
    return [this](std::string_view name, std::size_t first, std::span<float> out) {
      const auto t = std::ranges::find(tensors_, name, &Tensor::name);
      ZP_EXPECT(t != tensors_.end(), "gpt: no tensor '", name, "' on this rank");
      ZP_EXPECT(first + out.size() <= t->place.size(), "gpt: elements [", first, ", ",
                first + out.size(), ") of '", name, "' are past its ", t->place.size());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = float(initial_value(*t, first + i));
    };
  }

  // The engine's modules are this rank's, numbered from 0 (module m of the model is m - first).
  template <class V>
  friend void for_each_parameter(Model& m, V&& visit) {
    for (Tensor& t : m.tensors_) visit(t.name, t.module - m.first_, t.param, t.place);
  }

  // Allocates now, not at their first use, what a's blocks and logits hold for this rank's
  // modules and this model's F copies of a module, so that an engine built after this counts
  // them in its memory check.
  void reserve(Activations<F>& a) {
    for (int m = std::max(first_, 1); m < std::min(end_, cfg_.layers + 1); ++m)
      a.block(m - 1).resize(shape_, cfg_.context, a.batch);
    if (has_loss()) {
      a.logits.resize(std::size_t(a.rows(cfg_)) * vocab_.size());
      a.dlogits.resize(a.logits.size());
    }
    for (auto* buf : {&w_buf_, &g_buf_}) buf->resize(largest_);
  }

  // Module m's forward for the micro-batch in a (a.tokens set for module 0; a.x[m - 1] for others).
  void forward(int m, Activations<F>& a) {
    const Config& c = cfg_;
    const int rows = a.rows(c), d = c.d_model;
    load(m);
    if (m == 0) {
      auto& x = a.x[0];
      zp::tp::embedding_forward(tp_, vocab_, std::size_t(c.vocab), std::span<const F>(wf_[0]),
                                std::span<const int>(a.tokens), std::size_t(d), std::span<F>(x));
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < d; ++i)
          x[std::size_t(r * d + i)] += wf_[1][std::size_t((r % c.context) * d + i)];
    } else if (m <= c.layers) {
      block_forward(shape_, c.context, a.batch, weights(), a.x[std::size_t(m - 1)].data(),
                    a.x[std::size_t(m)].data(), a.block(m - 1), tp_);
      a.held = m - 1;
    } else {
      layernorm_forward(a.lnf.data(), a.meanf.data(), a.rstdf.data(),
                        a.x[std::size_t(c.layers)].data(), wf_[0].data(), wf_[1].data(), rows, d);
      a.logits.resize(std::size_t(rows) * vocab_.size());
      matmul_forward(a.logits.data(), a.lnf.data(), wf_[2].data(), static_cast<const F*>(nullptr),
                     rows, d, int(vocab_.size()));
    }
  }

  // Mean cross-entropy over the positions of the micro-batch whose target is not
  // zp::tp::ignore_index (0 if there are none), after the head's forward; seeds a.dlogits with
  // d(scale * loss)/d(logits) for backward (zero on ignored positions). Tokens and targets are
  // checked against the vocabulary by zp::tp. Collective over the TP group.
  F loss(Activations<F>& a, float scale) {
    a.dlogits.resize(a.logits.size());
    return zp::tp::cross_entropy(tp_, vocab_, std::size_t(cfg_.vocab), std::span<const F>(a.logits),
                                 std::span<const int>(a.targets), std::span<F>(a.dlogits),
                                 F(scale));
  }

  // Module m's backward: adds its parameters' gradients into their grad views (zp's rule) and,
  // for m > 0, writes a.dx[m - 1] from a.dx[m] (the head: from a.dlogits).
  void backward(int m, Activations<F>& a) {
    const Config& c = cfg_;
    const int rows = a.rows(c), d = c.d_model;
    load(m);
    const std::size_t first = module_tensors(m).first;
    bind(gf_, g_buf_, m);
    for (const std::span<F> g : gf_) std::ranges::fill(g, F(0));
    if (m == 0) {
      zp::tp::embedding_backward(vocab_, std::size_t(c.vocab), std::span<F>(gf_[0]),
                                 std::span<const int>(a.tokens), std::size_t(d),
                                 std::span<const F>(a.dx[0]));
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < d; ++i)
          gf_[1][std::size_t((r % c.context) * d + i)] += a.dx[0][std::size_t(r * d + i)];
    } else if (m <= c.layers) {
      BlockGrads<F> g;
      for (int t = 0; t < block_tensors; ++t) g[std::size_t(t)] = gf_[std::size_t(t)].data();
      if (a.recompute && a.held != m - 1) {  // the forward again, with the weights just loaded
        block_forward(shape_, c.context, a.batch, weights(), a.x[std::size_t(m - 1)].data(),
                      a.y.data(), a.block(m - 1), tp_);
        a.held = m - 1;
      }
      block_backward(shape_, c.context, a.batch, weights(), g, a.x[std::size_t(m - 1)].data(),
                     a.dx[std::size_t(m)].data(), a.dx[std::size_t(m - 1)].data(), a.block(m - 1),
                     tp_);
    } else {
      std::vector<F> dln(std::size_t(rows) * std::size_t(d));
      matmul_backward(dln.data(), gf_[2].data(), static_cast<F*>(nullptr), a.dlogits.data(),
                      a.lnf.data(), wf_[2].data(), rows, d, int(vocab_.size()));
      tp_.all_reduce(std::span<F>(dln));  // lm_head is column-parallel
      auto& dx = a.dx[std::size_t(c.layers)];
      std::fill(dx.begin(), dx.end(), F(0));
      layernorm_backward(dx.data(), gf_[0].data(), gf_[1].data(), dln.data(),
                         a.x[std::size_t(c.layers)].data(), a.meanf.data(), a.rstdf.data(),
                         wf_[0].data(), rows, d);
    }
    for (std::size_t k = 0; k < gf_.size(); ++k) {
      zp::View<T>& gv = tensors_[first + k].param.grad;
      for (std::size_t i = 0; i < gv.size(); ++i)
        gv[i] = detail::to_storage<T>(detail::to_compute<F>(gv[i]) + gf_[k][i]);
    }
  }

 private:
  // Element i of t's part: drawn from (seed, t's index, i's full index), so every rank draws its
  // part alone.
  double initial_value(const Tensor& t, std::size_t i) const {
    return t.std_dev == 0
               ? t.constant
               : t.std_dev * normal(seed_, std::uint64_t(t.index), t.place.full_index(i));
  }

  // A standard normal from (seed, tensor, index): splitmix64 and Box-Muller, the same on every
  // platform (std::normal_distribution is not).
  static double normal(std::uint64_t seed, std::uint64_t tensor, std::uint64_t i) {
    auto mix = [](std::uint64_t x) {
      x += 0x9e3779b97f4a7c15ull;
      x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
      x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
      return x ^ (x >> 31);
    };
    const std::uint64_t base =
        mix(mix(seed) ^ (tensor * 0xd1b54a32d192ed03ull)) ^ (i * 2 * 0x9e3779b97f4a7c15ull);
    const double u1 = (double(mix(base) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: the log stays finite
    const double u2 = double(mix(base + 1) >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

  // Module m's parameters in the compute type, into wf_ (one vector per tensor).
  void load(int m) {
    ZP_EXPECT(m >= first_ && m < end_, "gpt: module ", m, " is not one of this rank's modules [",
              first_, ", ", end_, ")");
    const std::size_t first = module_tensors(m).first;
    bind(wf_, w_buf_, m);
    for (std::size_t k = 0; k < wf_.size(); ++k) {
      const zp::View<T>& v = tensors_[first + k].param.value;
      for (std::size_t i = 0; i < v.size(); ++i) wf_[k][i] = detail::to_compute<F>(v[i]);
    }
  }
  // The tensors_ indices of module m's tensors: [first, end).
  std::pair<std::size_t, std::size_t> module_tensors(int m) const {
    return {module_begin_[std::size_t(m - first_)], module_begin_[std::size_t(m - first_ + 1)]};
  }
  // views: module m's tensors, one after another in buf (sized once, for the largest module).
  void bind(std::vector<std::span<F>>& views, std::vector<F>& buf, int m) {
    const auto [first, end] = module_tensors(m);
    buf.resize(largest_);
    views.clear();
    std::size_t at = 0;
    for (std::size_t t = first; t < end; ++t) {
      views.emplace_back(buf.data() + at, tensors_[t].place.size());
      at += tensors_[t].place.size();
    }
  }
  BlockWeights<F> weights() const {
    BlockWeights<F> w;
    for (int t = 0; t < block_tensors; ++t) w[std::size_t(t)] = wf_[std::size_t(t)].data();
    return w;
  }

  Config cfg_;
  zp::tp::Group<F> tp_;
  std::uint64_t seed_;  // of the initial values
  int first_ = 0, end_ = 0;
  zp::tp::Range vocab_;
  BlockShape shape_;
  std::vector<Tensor> tensors_;
  std::vector<std::size_t>
      module_begin_;                   // tensors_ index of each of this rank's modules, and the end
  std::size_t largest_ = 0;            // elements of this rank's largest module
  std::vector<F> w_buf_, g_buf_;       // largest_ each, from the first use (or reserve)
  std::vector<std::span<F>> wf_, gf_;  // the current module's weights and gradients in F
};

// ---- sampling -------------------------------------------------------------------------------

struct SampleOptions {
  int count = 0;             // tokens to generate
  double temperature = 1.0;  // the logits are divided by it; 0: always the most likely token
  int top_k = 0;             // draw among the k most likely tokens only; 0: among all
  std::uint64_t seed = 1;
};

// The index drawn from logits (one row of the head's output) as `o` says, with u uniform in
// [0, 1): the softmax of logits / temperature over the top_k largest, inverted at u; the first
// largest logit when temperature is 0.
template <class F>
int draw(std::span<const F> logits, const SampleOptions& o, double u) {
  const auto best = std::max_element(logits.begin(), logits.end());
  if (o.temperature == 0) return int(best - logits.begin());
  std::vector<int> order(logits.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  const std::size_t k = o.top_k > 0 ? std::min(std::size_t(o.top_k), order.size()) : order.size();
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[std::size_t(a)] > logits[std::size_t(b)]; });
  std::vector<double> p(k);
  double total = 0;
  for (std::size_t j = 0; j < k; ++j)
    total += p[j] =
        std::exp((double(logits[std::size_t(order[j])]) - double(*best)) / o.temperature);
  double acc = 0;
  for (std::size_t j = 0; j < k; ++j)
    if ((acc += p[j] / total) > u) return order[j];
  return order[k - 1];
}

// The whole model's parameters in its forward order (as Engine::gather_params returns them on a
// data-parallel grid), from `mine`, this rank's part of them (Engine::gather_params on a grid
// rank: `part`'s tensors in order), assembled over `mp`, the replica's TP x PP group: each tensor
// from the parts that hold it (a replicated one from TP rank 0), bit for bit. Collective over mp;
// every rank of it gets the whole model (examples' sizes: it is one all_reduce).
template <class T, class F, zp::Backend B>
std::vector<T> gather_whole(const Model<T, F>& part, std::span<const T> mine, zp::Collective<B>& mp,
                            int tp_rank) {
  const Model<T, F> whole(part.config(), 0);
  std::vector<std::size_t> offsets;  // of each whole tensor
  std::size_t total = 0;
  for (const auto& t : whole.tensors()) offsets.push_back(total), total += t.place.size();
  // The values' bits, summed: every element has exactly one contributor, so the sum is exact.
  std::vector<std::int64_t> bits(total, 0);
  std::size_t at = 0;
  for (const auto& t : part.tensors()) {
    std::size_t k = 0;
    while (whole.tensors()[k].name != t.name) ++k;
    if (!t.place.is_whole() || tp_rank == 0)
      for (std::size_t i = 0; i < t.place.size(); ++i) {
        std::int64_t b = 0;
        std::memcpy(&b, &mine[at + i], sizeof(T));
        bits[offsets[k] + t.place.full_index(i)] = b;
      }
    at += t.place.size();
  }
  ZP_EXPECT(at == mine.size(), "gpt: gather_whole got ", mine.size(),
            " values for a part of the model with ", at);
  mp.all_reduce(std::span<std::int64_t>(bits), zp::ReduceOp::sum);
  std::vector<T> out(total);
  for (std::size_t i = 0; i < total; ++i) std::memcpy(&out[i], &bits[i], sizeof(T));
  return out;
}

// `o.count` tokens generated after `prompt` by a whole model (one rank: no tensor or pipeline
// split): each from the logits at the last position of the last `context` tokens. The positions
// after the last token are filled with it; causal attention keeps them out of the logits read.
template <class T, class F>
std::vector<int> sample(Model<T, F>& model, std::vector<int> prompt, const SampleOptions& o) {
  const Config& c = model.config();
  ZP_EXPECT(model.whole(),
            "gpt: sampling needs the whole model on one rank (no tensor or pipeline split)");
  ZP_EXPECT(!prompt.empty(), "gpt: sampling needs a prompt of at least one token");
  ZP_EXPECT(o.temperature >= 0 && std::isfinite(o.temperature), "gpt: temperature ", o.temperature,
            " is not a finite number >= 0");
  for (int t : prompt)
    ZP_EXPECT(t >= 0 && t < c.vocab, "gpt: prompt token ", t, " is not in the vocabulary [0, ",
              c.vocab, ")");
  Activations<F> a(c, 1);
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<int> out;
  for (int n = 0; n < o.count; ++n) {
    const std::size_t len = std::min(prompt.size(), std::size_t(c.context));
    std::copy(prompt.end() - std::ptrdiff_t(len), prompt.end(), a.tokens.begin());
    std::fill(a.tokens.begin() + std::ptrdiff_t(len), a.tokens.end(), prompt.back());
    for (int m = 0; m < model.modules(); ++m) model.forward(m, a);
    const std::size_t V = std::size_t(c.vocab);
    const int next = draw(std::span<const F>(a.logits).subspan((len - 1) * V, V), o, uniform(rng));
    out.push_back(next);
    prompt.push_back(next);
  }
  return out;
}

// The mean loss of predicting every next token of `ids`, each once, by a whole model: windows of
// context + 1 tokens (the first context the input, the last context the targets), each window
// starting where the last one's targets end, `batch` windows a forward; the last window's
// missing targets are left out of the loss.
template <class T, class F>
double evaluate(Model<T, F>& model, std::span<const int> ids, int batch) {
  const Config& c = model.config();
  ZP_EXPECT(model.whole(),
            "gpt: evaluation needs the whole model on one rank (no tensor or pipeline split)");
  ZP_EXPECT(ids.size() >= 2, "gpt: evaluation needs at least 2 tokens, got ", ids.size());
  const std::size_t context = std::size_t(c.context), predictions = ids.size() - 1,
                    windows = (predictions + context - 1) / context;
  Activations<F> a(c, batch);
  double sum = 0;
  for (std::size_t first = 0; first < windows; first += std::size_t(batch)) {
    std::size_t counted = 0;
    for (std::size_t r = 0; r < a.tokens.size(); ++r) {
      const std::size_t i = (first + r / context) * context + r % context;  // the input's index
      const bool in = i < predictions;
      a.tokens[r] = in ? ids[i] : 0;  // causal attention keeps padding out of the logits read
      a.targets[r] = in ? ids[i + 1] : zp::tp::ignore_index;
      counted += in;
    }
    for (int m = 0; m < model.modules(); ++m) model.forward(m, a);
    sum += double(model.loss(a, 1.0f)) * double(counted);
  }
  return sum / double(predictions);
}

// The modules of pipeline stage `stage` of `stages`: the model's layers + 2 modules cut into
// contiguous ranges of nearly equal count.
inline std::pair<int, int> pipeline_stage(const Config& c, int stages, int stage) {
  ZP_EXPECT(stages >= 1 && stages <= c.layers + 2, "gpt: ", stages,
            " pipeline stages for a model of ", c.layers + 2, " modules (", c.layers,
            " layers + embedding + head); at most one stage per module");
  const zp::tp::Range r = zp::tp::split(std::size_t(c.layers + 2), stages, stage);
  return {int(r.begin), int(r.end)};
}

// What one optimizer step of train_step() did on this rank.
struct StepOut {
  zp::StepResult result;  // the flush's engine.step(): the accumulation boundary
  double loss = 0;  // mean of the micro-batches' losses (Model::loss) on a last-stage rank, else 0
};

// One optimizer step of a rank's part of the model on any grid: the pipeline runner's schedule
// over the engine's accumulation window (one micro-batch per accumulation step), each module
// inside the engine's guards, engine.step() after every micro-batch's backward, the last one
// after the flush: the accumulation boundary. ZeRO's reductions overlap the rest of the
// schedule. slots: runner.slots() activation sets, reused as the runner says; fill(micro, a)
// writes the micro-batch's tokens and targets.
template <class E, class B, class T, class F, class Fill>
StepOut train_step(E& engine, Model<T, F>& model, zp::pipeline::Runner<B, F>& runner,
                   std::vector<Activations<F>>& slots, Fill&& fill) {
  ZP_EXPECT(runner.micro_batches() == engine.batch().gradient_accumulation_steps,
            "gpt: the pipeline runs ", runner.micro_batches(),
            " micro-batches per flush but the engine accumulates ",
            engine.batch().gradient_accumulation_steps, "; they must be equal");
  ZP_EXPECT(slots.size() >= std::size_t(runner.slots()), "gpt: ", slots.size(),
            " activation sets for ", runner.slots(), " pipeline slots");
  const int first = model.first_module(), end = model.end_module();
  // The boundaries copy one micro-batch's residual stream; stage 0 embeds, the last has the loss.
  for (const Activations<F>& a : slots)
    ZP_EXPECT(a.x.front().size() == runner.activation_elems(),
              "gpt: the pipeline's boundary holds ", runner.activation_elems(),
              " elements, a micro-batch's residual stream ", a.x.front().size(),
              " (micro_batch x context x d_model)");
  const bool last = runner.stage() == runner.stages() - 1;
  ZP_EXPECT((first == 0) == (runner.stage() == 0) && model.has_loss() == last, "gpt: modules [",
            first, ", ", end, ") of ", model.config().layers + 2, " on pipeline stage ",
            runner.stage(), " of ", runner.stages(),
            ": the first stage must hold module 0 and the last the head (gpt::pipeline_stage)");
  StepOut out;
  int backwards = 0;
  runner.run(
      [&](int micro, int slot, std::span<const F> in, std::span<F> to_next) {
        Activations<F>& a = slots[std::size_t(slot)];
        fill(micro, a);
        if (first > 0) std::copy(in.begin(), in.end(), a.x[std::size_t(first - 1)].begin());
        for (int m = first; m < end; ++m) {
          auto guard = engine.forward(m - first);
          model.forward(m, a);
        }
        if (model.has_loss())
          out.loss += double(model.loss(a, engine.loss_scale()));
        else
          std::copy_n(a.x[std::size_t(end - 1)].begin(), to_next.size(), to_next.begin());
      },
      [&](int, int slot, std::span<const F> from_next, std::span<F> to_prev) {
        Activations<F>& a = slots[std::size_t(slot)];
        if (!model.has_loss())
          std::copy(from_next.begin(), from_next.end(), a.dx[std::size_t(end - 1)].begin());
        for (int m = end - 1; m >= first; --m) {
          auto guard = engine.backward(m - first);
          model.backward(m, a);
        }
        if (first > 0)
          std::copy_n(a.dx[std::size_t(first - 1)].begin(), to_prev.size(), to_prev.begin());
        if (++backwards < runner.micro_batches()) engine.step();
      });
  // The boundary's step() is collective over the replica's stages (the gradient norm): it must
  // come after the runner sent the last input gradient, which the previous stage still awaits.
  out.result = engine.step();
  out.loss /= double(runner.micro_batches());
  return out;
}

}  // namespace gpt
