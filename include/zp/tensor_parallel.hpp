// zp/tensor_parallel.hpp: the communication of Megatron-LM's tensor-parallel layers, around
// the user's own kernels. A TP group (ProcessGrid::tp()) splits each layer's matrices:
//
//   column-parallel linear  Y_r = X A_r   (A split by columns; X replicated on every rank)
//     forward: nothing;                  backward: dX = sum_r dY_r A_r^T  -> all_reduce(dX)
//   row-parallel linear     Y = sum_r X_r A_r   (A split by rows; X_r = a column-parallel output)
//     forward: all_reduce(Y), then the bias; backward: nothing (dY is replicated)
//   vocabulary-parallel embedding: rank r holds rows [v0, v1) of the table; a token outside them
//     contributes zeros; forward all_reduce(X); backward: local rows only
//   vocabulary-parallel cross-entropy over logits split by columns: all_reduce of each row's max,
//     then one of (sum of exp, the target's logit); the gradient softmax - onehot is local
//
// So a transformer layer moves 4 all_reduces of b x s x h per micro-batch (2 forward: attention
// and MLP outputs; 2 backward: the inputs of the two column-parallel products), and the model
// adds one for the embedding, one for the head's input gradient and 3 b x s for the loss.
//
//   zp::tp::Group<float> tp(grid.tp());                    // type-erased: models need no template
//   const auto cols = zp::tp::split(4 * d, tp.size(), tp.rank());   // this rank's MLP columns
//   my_matmul(h, x, w_fc_slice, ...);                      // [rows, cols.size()]
//   my_matmul(y, gelu(h), w_proj_slice, ...);              // partial sums of [rows, d]
//   tp.all_reduce(y);                                      // row-parallel output
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"

namespace zp::tp {

// A contiguous range [begin, end) of a split dimension.
struct Range {
  std::size_t begin = 0, end = 0;
  std::size_t size() const noexcept { return end - begin; }
  bool contains(std::size_t i) const noexcept { return i >= begin && i < end; }
};

// Part `index` of `n` items cut into `parts` contiguous ranges, the first n % parts one larger.
inline Range split(std::size_t n, int parts, int index) {
  ZP_EXPECT(parts >= 1 && index >= 0 && index < parts, "tp::split: part ", index, " of ", parts,
            " is not a part; expected 0 <= index < parts");
  const auto [begin, end] = detail::even_part(n, parts, index);
  return {begin, end};
}

// A tensor-parallel group as layers see it: rank, size, and an all_reduce of F in place. A
// default Group is one rank (no communication), so one model code serves TP = 1 and TP > 1.
template <class F>
class Group {
 public:
  Group() = default;
  template <Backend B>
  explicit Group(Collective<B>& c)
      : rank_(c.rank()), size_(c.size()), reduce_([&c](std::span<F> x, ReduceOp op) { c.all_reduce(x, op); }) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  void all_reduce(std::span<F> x, ReduceOp op = ReduceOp::sum) const {
    if (size_ > 1) reduce_(x, op);
  }

 private:
  int rank_ = 0, size_ = 1;
  std::function<void(std::span<F>, ReduceOp)> reduce_;
};

// out[i] = row tokens[i] of the full [vocab, d] table, from this rank's rows `vocab` (weight is
// [vocab.size(), d]). Collective over the group.
template <class F>
void embedding_forward(const Group<F>& g, Range vocab, std::span<const F> weight, std::span<const int> tokens,
                       std::size_t d, std::span<F> out) {
  ZP_EXPECT(weight.size() == vocab.size() * d && out.size() == tokens.size() * d, "tp::embedding_forward: weight has ",
            weight.size(), " elements (expected ", vocab.size(), " rows x ", d, ") and out ", out.size(),
            " (expected ", tokens.size(), " tokens x ", d, ")");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    F* o = out.data() + i * d;
    const std::size_t t = std::size_t(tokens[i]);
    if (tokens[i] >= 0 && vocab.contains(t)) std::copy_n(weight.data() + (t - vocab.begin) * d, d, o);
    else std::fill_n(o, d, F(0));
  }
  g.all_reduce(out);
}

// Adds d loss/d out into this rank's rows of the table gradient. No communication.
template <class F>
void embedding_backward(Range vocab, std::span<F> weight_grad, std::span<const int> tokens, std::size_t d,
                        std::span<const F> out_grad) {
  ZP_EXPECT(weight_grad.size() == vocab.size() * d && out_grad.size() == tokens.size() * d,
            "tp::embedding_backward: sizes do not match ", vocab.size(), " rows x ", d, " and ", tokens.size(), " tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::size_t t = std::size_t(tokens[i]);
    if (tokens[i] < 0 || !vocab.contains(t)) continue;
    F* w = weight_grad.data() + (t - vocab.begin) * d;
    const F* o = out_grad.data() + i * d;
    for (std::size_t k = 0; k < d; ++k) w[k] += o[k];
  }
}

// Mean cross-entropy of `targets` over rows whose logits are split by columns: this rank holds
// columns `vocab` of each row (logits is [rows, vocab.size()]). Writes dlogits = scale * d(mean
// loss)/d(logits) for this rank's columns and returns the mean loss (the same on every rank).
// Collective over the group: two all_reduces, of rows and 2 x rows elements.
template <class F>
F cross_entropy(const Group<F>& g, Range vocab, std::span<const F> logits, std::span<const int> targets,
                std::span<F> dlogits, F scale) {
  const std::size_t rows = targets.size(), V = vocab.size();
  ZP_EXPECT(logits.size() == rows * V && dlogits.size() == logits.size(), "tp::cross_entropy: logits have ",
            logits.size(), " elements and dlogits ", dlogits.size(), "; expected ", rows, " rows x ", V, " columns");
  std::vector<F> mx(rows), sums(2 * rows, F(0));  // sums: sum of exp, then the target's logit
  for (std::size_t r = 0; r < rows; ++r) {
    const F* z = logits.data() + r * V;
    mx[r] = V ? *std::max_element(z, z + V) : F(-INFINITY);
  }
  g.all_reduce(std::span<F>(mx), ReduceOp::max);
  for (std::size_t r = 0; r < rows; ++r) {
    const F* z = logits.data() + r * V;
    F* e = dlogits.data() + r * V;
    F se = 0;
    for (std::size_t v = 0; v < V; ++v) se += (e[v] = std::exp(z[v] - mx[r]));
    sums[r] = se;
    const int t = targets[r];
    if (t >= 0 && vocab.contains(std::size_t(t))) sums[rows + r] = z[std::size_t(t) - vocab.begin];
  }
  g.all_reduce(std::span<F>(sums));
  F total = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    total += std::log(sums[r]) + mx[r] - sums[rows + r];
    F* e = dlogits.data() + r * V;
    const std::size_t t = std::size_t(targets[r]);
    for (std::size_t v = 0; v < V; ++v)
      e[v] = (e[v] / sums[r] - (vocab.begin + v == t ? F(1) : F(0))) * scale / F(rows);
  }
  return total / F(rows);
}

}  // namespace zp::tp
