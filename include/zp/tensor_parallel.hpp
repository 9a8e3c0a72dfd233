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
// Tokens and targets are indices into the whole vocabulary [0, V), so these functions take V as
// well as this rank's range. Targets equal to ignore_index (-100, PyTorch's default) add no loss
// and no gradient. Any other index outside [0, V) is an Errc::invalid_argument naming it, its
// position and V, raised before any communication: the indices are replicated over the group, so
// every rank throws the same error and none is left waiting in an all_reduce.
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
  const auto [begin, end] = zp::detail::even_part(n, parts, index);
  return {begin, end};
}

// A target equal to this adds no loss and no gradient (PyTorch cross_entropy's default
// ignore_index; e.g. padding).
inline constexpr int ignore_index = -100;

namespace detail {
// Every index in [0, vocab_size), or ignore_index where `ignorable`; and `vocab`, this rank's
// part, inside [0, vocab_size). Runs before any collective (see the file comment).
inline void check_indices(const char* who, const char* what, std::span<const int> idx, Range vocab,
                          std::size_t vocab_size, bool ignorable) {
  ZP_EXPECT(vocab.begin <= vocab.end && vocab.end <= vocab_size, who,
            ": this rank's vocabulary part [", vocab.begin, ", ", vocab.end,
            ") is not a range inside the vocabulary [0, ", vocab_size, ")");
  for (std::size_t i = 0; i < idx.size(); ++i)
    ZP_EXPECT(
        (idx[i] >= 0 && std::size_t(idx[i]) < vocab_size) || (ignorable && idx[i] == ignore_index),
        who, ": ", what, " ", idx[i], " at position ", i, " is outside the vocabulary [0, ",
        vocab_size, ")", ignorable ? " and is not ignore_index (-100)" : "");
}
}  // namespace detail

// A tensor-parallel group as layers see it: rank, size, and an all_reduce of F in place. A
// default Group is one rank (no communication), so one model code serves TP = 1 and TP > 1.
template <class F>
class Group {
 public:
  Group() = default;
  template <Backend B>
  explicit Group(Collective<B>& c)
      : rank_(c.rank()),
        size_(c.size()),
        reduce_([&c](std::span<F> x, ReduceOp op) { c.all_reduce(x, op); }) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  void all_reduce(std::span<F> x, ReduceOp op = ReduceOp::sum) const {
    if (size_ > 1) reduce_(x, op);
  }

 private:
  int rank_ = 0, size_ = 1;
  std::function<void(std::span<F>, ReduceOp)> reduce_;
};

// out[i] = row tokens[i] of the full [vocab_size, d] table, from this rank's rows `vocab` (weight
// is [vocab.size(), d]); every token in [0, vocab_size). Collective over the group.
template <class F>
void embedding_forward(const Group<F>& g, Range vocab, std::size_t vocab_size,
                       std::span<const F> weight, std::span<const int> tokens, std::size_t d,
                       std::span<F> out) {
  detail::check_indices("tp::embedding_forward", "token", tokens, vocab, vocab_size, false);
  using zp::detail::checked_mul;  // a wrapped product could match a short buffer
  ZP_EXPECT(weight.size() == checked_mul(vocab.size(), d, "tp::embedding_forward: rows x d") &&
                out.size() == checked_mul(tokens.size(), d, "tp::embedding_forward: tokens x d"),
            "tp::embedding_forward: weight has ", weight.size(), " elements (expected ",
            vocab.size(), " rows x ", d, ") and out ", out.size(), " (expected ", tokens.size(),
            " tokens x ", d, ")");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    F* o = out.data() + i * d;
    const std::size_t t = std::size_t(tokens[i]);
    if (vocab.contains(t))
      std::copy_n(weight.data() + (t - vocab.begin) * d, d, o);
    else
      std::fill_n(o, d, F(0));
  }
  g.all_reduce(out);
}

// Adds d loss/d out into this rank's rows of the table gradient; every token in [0, vocab_size).
// No communication.
template <class F>
void embedding_backward(Range vocab, std::size_t vocab_size, std::span<F> weight_grad,
                        std::span<const int> tokens, std::size_t d, std::span<const F> out_grad) {
  detail::check_indices("tp::embedding_backward", "token", tokens, vocab, vocab_size, false);
  using zp::detail::checked_mul;
  ZP_EXPECT(
      weight_grad.size() == checked_mul(vocab.size(), d, "tp::embedding_backward: rows x d") &&
          out_grad.size() == checked_mul(tokens.size(), d, "tp::embedding_backward: tokens x d"),
      "tp::embedding_backward: sizes do not match ", vocab.size(), " rows x ", d, " and ",
      tokens.size(), " tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::size_t t = std::size_t(tokens[i]);
    if (!vocab.contains(t)) continue;
    F* w = weight_grad.data() + (t - vocab.begin) * d;
    const F* o = out_grad.data() + i * d;
    for (std::size_t k = 0; k < d; ++k) w[k] += o[k];
  }
}

// Mean cross-entropy of `targets` over rows whose logits are split by columns: this rank holds
// columns `vocab` of each row's vocab_size (logits is [rows, vocab.size()]). The mean is over the
// rows whose target is not ignore_index; ignored rows get a zero gradient, and when every row is
// ignored (or there are none) the loss is 0 and so is dlogits. Writes dlogits = scale * d(mean
// loss)/d(logits) for this rank's columns and returns the mean loss (the same on every rank).
// Collective over the group: two all_reduces, of rows and 2 x rows elements.
template <class F>
F cross_entropy(const Group<F>& g, Range vocab, std::size_t vocab_size, std::span<const F> logits,
                std::span<const int> targets, std::span<F> dlogits, F scale) {
  detail::check_indices("tp::cross_entropy", "target", targets, vocab, vocab_size, true);
  const std::size_t rows = targets.size(), V = vocab.size();
  ZP_EXPECT(
      logits.size() == zp::detail::checked_mul(rows, V, "tp::cross_entropy: rows x columns") &&
          dlogits.size() == logits.size(),
      "tp::cross_entropy: logits have ", logits.size(), " elements and dlogits ", dlogits.size(),
      "; expected ", rows, " rows x ", V, " columns");
  const auto ignored = std::size_t(std::count(targets.begin(), targets.end(), ignore_index));
  const std::size_t kept = rows - ignored;        // the rows the mean is over
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
    if (t != ignore_index && vocab.contains(std::size_t(t)))
      sums[rows + r] = z[std::size_t(t) - vocab.begin];
  }
  g.all_reduce(std::span<F>(sums));
  F total = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    F* e = dlogits.data() + r * V;
    if (targets[r] == ignore_index) {
      std::fill_n(e, V, F(0));
      continue;
    }
    total += std::log(sums[r]) + mx[r] - sums[rows + r];
    const std::size_t t = std::size_t(targets[r]);
    for (std::size_t v = 0; v < V; ++v)
      e[v] = (e[v] / sums[r] - (vocab.begin + v == t ? F(1) : F(0))) * scale / F(kept);
  }
  return kept ? total / F(kept) : F(0);
}

}  // namespace zp::tp
