// zp/quantized_collectives.hpp: ZeRO++'s quantized communication (issue #22), built from
// quantize.hpp's element math and the collectives' all_gather / all_to_all. Records are packed
// and unpacked, and qgZ's reduce_scatter runs, on the host or in device memory.
//
// A record is one piece of n values quantized in Format f, as 32-bit words: its codes (padded to
// a word), then its fp32 scales, so a piece travels in one collective of a dtype every backend
// has (i32). qwZ's gathers (param_coordinator.hpp) move records; qgZ's reduce-scatter moves them
// twice:
//
//   reduce_scatter(node, peers, in, out, f): ranks form nodes of h = node.size() consecutive
//   ranks, world rank r = peers.rank() * h + node.rank(); `in` holds one piece per world rank
//   (rank r's at r * piece), `out` receives the sum over ranks of this rank's piece, in fp32.
//     hop 1, inside the node: each rank sends local rank j the records of the pieces of ranks
//       j, h + j, 2h + j, ... (all_to_all over `node`); local rank j dequantizes and adds them in
//       fp32, local rank by local rank: the node's partial sum of those pieces;
//     hop 2, across nodes among ranks of the same local index: each partial is requantized and
//       sent to the node that owns its piece (all_to_all over `peers`), which dequantizes and
//       adds them in node order.
//   Every addition runs in a fixed order on one rank, so any backend gives the same bits. Bytes:
//   hop 1 moves N x record_words(f, piece) words per rank (S, nccl-tests' convention), hop 2
//   (the only one that crosses nodes) N / h of them. A piece with an inf or NaN gives NaN in the
//   blocks it reaches: the overflow the loss scaler sees.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/quantize.hpp"

namespace zp::quant {

// Words of the codes of n values, and of the whole record.
inline std::size_t code_words(const Format& f, std::size_t n) { return (f.code_bytes(n) + 3) / 4; }
inline std::size_t record_words(const Format& f, std::size_t n) {
  return code_words(f, n) + f.blocks(n);
}

namespace detail {
inline std::vector<float>& scale_scratch(std::size_t n) {
  thread_local std::vector<float> scales;  // a record's scales, in and out of its words
  scales.resize(n);
  return scales;
}
}  // namespace detail

// x -> its record (record_words(f, x.size()) words; the codes' padding zeroed), in memory space
// S (host: quantize's best path; a device: the work items, on the current stream).
template <MemorySpace S = MemorySpace::host, class T>
void pack(std::span<const T> x, const Format& f, std::span<std::int32_t> record) {
  f.check();  // (before sizing the record: a block of 0 divides by zero)
  const std::size_t n = x.size(), cw = code_words(f, n);
  ZP_EXPECT(record.size() == record_words(f, n), "quantize: a record of ", n, " values takes ",
            record_words(f, n), " words, got ", record.size());
  // The padding after the codes (quantize writes the rest of the word).
  if (cw > 0) Memory<S>::zero(record.subspan(cw - 1, 1));
  if constexpr (S == MemorySpace::host) {
    std::vector<float>& scales = detail::scale_scratch(f.blocks(n));
    quantize(x, f, std::span(reinterpret_cast<std::uint8_t*>(record.data()), f.code_bytes(n)),
             std::span<float>(scales));
    if (!scales.empty())  // (an empty piece's record may have no storage)
      std::memcpy(record.data() + cw, scales.data(), scales.size() * sizeof(float));
  } else {
    Memory<S>::for_each(
        f.blocks(n),
        QuantizeBlock<T>{x.data(), n, f, reinterpret_cast<std::uint8_t*>(record.data()),
                         reinterpret_cast<float*>(record.data() + cw)});
  }
}

// A record of out.size() values -> out (Add: acc += them, in fp32), in memory space S.
template <bool Add = false, MemorySpace S = MemorySpace::host, class T>
void unpack(const Format& f, std::span<const std::int32_t> record, std::span<T> out) {
  f.check();  // (before sizing the record)
  const std::size_t n = out.size(), cw = code_words(f, n);
  ZP_EXPECT(record.size() == record_words(f, n), "dequantize: a record of ", n, " values takes ",
            record_words(f, n), " words, got ", record.size());
  const auto* codes = reinterpret_cast<const std::uint8_t*>(record.data());
  if constexpr (S == MemorySpace::host) {
    std::vector<float>& scales = detail::scale_scratch(f.blocks(n));
    if (!scales.empty())
      std::memcpy(scales.data(), record.data() + cw, scales.size() * sizeof(float));
    const std::span<const std::uint8_t> c(codes, f.code_bytes(n));
    if constexpr (Add)
      dequantize_add(f, c, std::span<const float>(scales), out);
    else
      dequantize(f, c, std::span<const float>(scales), out);
  } else {
    Memory<S>::for_each(f.blocks(n), DequantizeBlock<T, Add>{
                                         codes, reinterpret_cast<const float*>(record.data() + cw),
                                         n, f, out.data()});
  }
}

// The scratch reduce_scatter needs for pieces of `piece` values on `ranks` ranks in `nodes`
// nodes: send and recv records (each), then the node's partial sums.
struct ReduceScratchSize {
  std::size_t records, partial;
};
inline ReduceScratchSize reduce_scratch(const Format& f, std::size_t ranks, std::size_t nodes,
                                        std::size_t piece) {
  return {ranks * record_words(f, piece), nodes * piece};
}

// qgZ's two-hop reduce-scatter (see the top of this file) in flight, through caller-owned
// scratch of at least reduce_scratch()'s sizes, which it uses until it is finished. Everything in
// the backend's memory (a device: the packing and sums on the rank's compute stream).
// start() packs hop 1's records and starts its all_to_all; advance() waits for hop 1, sums its
// records and starts hop 2; finish() waits for it to end. Each call issues collectives, so every
// rank must make the same calls in the same order (a backend may run one process's operations,
// over all its communicators, one after the other in the order they were issued).
template <Backend B, class T>
class ReduceScatter {
 public:
  ReduceScatter(Collective<B>& node, Collective<B>& peers, std::span<const T> in,
                std::span<float> out, const Format& f, std::span<std::int32_t> send,
                std::span<std::int32_t> recv, std::span<float> partial)
      : node_(&node),
        peers_(&peers),
        in_(in),
        out_(out),
        f_(f),
        h_(std::size_t(node.size())),
        nodes_(std::size_t(peers.size())),
        rw_((f.check(), record_words(f, out.size()))) {
    const std::size_t ranks = h_ * nodes_, piece = out.size();
    ZP_EXPECT(in.size() == ranks * piece, "quantized reduce_scatter: ", in.size(),
              " values in for ", ranks, " ranks (", nodes_, " nodes of ", h_, ") of ", piece,
              " each");
    const ReduceScratchSize need = reduce_scratch(f, ranks, nodes_, piece);
    ZP_EXPECT(send.size() >= need.records && recv.size() >= need.records &&
                  partial.size() >= need.partial,
              "quantized reduce_scatter: scratch of ", send.size(), ", ", recv.size(), " and ",
              partial.size(), " elements, less than ", need.records, " record words and ",
              need.partial, " partial sums");
    send_ = send.first(need.records);
    recv_ = recv.first(need.records);
    partial_ = partial.first(need.partial);
  }
  ReduceScatter(const ReduceScatter&) = delete;
  ReduceScatter& operator=(const ReduceScatter&) = delete;

  // Hop 1: block j of the send buffer holds, node by node, the pieces local rank j sums.
  void start() {
    const std::size_t piece = out_.size();
    for (std::size_t j = 0; j < h_; ++j)
      for (std::size_t n = 0; n < nodes_; ++n)
        pack<S>(in_.subspan((n * h_ + j) * piece, piece), f_,
                send_.subspan((j * nodes_ + n) * rw_, rw_));
    work_ = node_->all_to_all_async(std::span<const std::int32_t>(send_), recv_);
    hop_ = 1;
  }
  // Hop 1 done and hop 2 started (if hop 1 is in flight).
  void advance() {
    ended_on_error([&] {
      if (hop_ != 1) return;
      work_.wait();
      next();
    });
  }
  void finish() {
    ended_on_error([&] {
      while (hop_ != 0) {
        work_.wait();
        next();
      }
    });
  }

 private:
  // The hop in flight is done: hop 1's records summed and hop 2 started, or hop 2's summed.
  void next() {
    const std::size_t piece = out_.size();
    // Record r into sum; a sum's first record written, not added to zeros: one pass less, and
    // the same bits (no product of a code and a scale is -0: a scale is 0 only where every code
    // is, and a nonzero code times a nonzero scale does not round to 0).
    const auto add = [&](bool first, std::size_t r, std::span<float> sum) {
      const std::span<const std::int32_t> record(recv_.subspan(r * rw_, rw_));
      first ? unpack<false, S>(f_, record, sum) : unpack<true, S>(f_, record, sum);
    };
    if (hop_ == 2) {
      for (std::size_t n = 0; n < nodes_; ++n) add(n == 0, n, out_);
      hop_ = 0;
      return;
    }
    for (std::size_t i = 0; i < h_; ++i)  // node n's sum of rank n*h+me's piece
      for (std::size_t n = 0; n < nodes_; ++n)
        add(i == 0, i * nodes_ + n, partial_.subspan(n * piece, piece));
    // Hop 2: the partial of node n's piece to node n.
    for (std::size_t n = 0; n < nodes_; ++n)
      pack<S>(std::span<const float>(partial_.subspan(n * piece, piece)), f_,
              send_.subspan(n * rw_, rw_));
    work_ = peers_->all_to_all_async(std::span<const std::int32_t>(send_.first(nodes_ * rw_)),
                                     recv_.first(nodes_ * rw_));
    hop_ = 2;
  }

  // An operation whose hop failed ends there (its error on its way up); it posts nothing more.
  template <class F>
  void ended_on_error(F&& f) {
    try {
      f();
    } catch (...) {
      hop_ = 0;
      throw;
    }
  }

  static constexpr MemorySpace S = B::memory;
  Collective<B>*node_, *peers_;
  std::span<const T> in_;
  std::span<float> out_;
  Format f_;
  std::size_t h_, nodes_, rw_;
  std::span<std::int32_t> send_, recv_;
  std::span<float> partial_;
  int hop_ = 0;                        // the hop in flight (0: none)
  typename Collective<B>::Work work_;  // last: waited for (destroyed) before anything it uses
};

// ... blocking.
template <Backend B, class T>
void reduce_scatter(Collective<B>& node, Collective<B>& peers, std::span<const T> in,
                    std::span<float> out, const Format& f, std::span<std::int32_t> send,
                    std::span<std::int32_t> recv, std::span<float> partial) {
  ReduceScatter<B, T> op(node, peers, in, out, f, send, recv, partial);
  op.start();
  op.finish();
}

// ... with scratch of its own (host memory).
template <Backend B, class T>
  requires(B::memory == MemorySpace::host)
void reduce_scatter(Collective<B>& node, Collective<B>& peers, std::span<const T> in,
                    std::span<float> out, const Format& f) {
  const ReduceScratchSize need =
      reduce_scratch(f, std::size_t(node.size()) * std::size_t(peers.size()),
                     std::size_t(peers.size()), out.size());
  std::vector<std::int32_t> send(need.records), recv(need.records);
  std::vector<float> partial(need.partial);
  reduce_scatter(node, peers, in, out, f, std::span(send), std::span(recv), std::span(partial));
}

}  // namespace zp::quant
