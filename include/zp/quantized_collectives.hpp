// zp/quantized_collectives.hpp: ZeRO++'s quantized communication on the host (issue #22), built
// from quantize.hpp's element math and the collectives' all_gather / all_to_all.
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"
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

// x -> its record (record_words(f, x.size()) words; the codes' padding zeroed).
template <class T>
void pack(std::span<const T> x, const Format& f, std::span<std::int32_t> record) {
  const std::size_t cw = code_words(f, x.size());
  ZP_EXPECT(record.size() == record_words(f, x.size()), "quantize: a record of ", x.size(),
            " values takes ", record_words(f, x.size()), " words, got ", record.size());
  std::vector<float>& scales = detail::scale_scratch(f.blocks(x.size()));
  std::fill_n(record.data(), cw, 0);
  quantize(x, f, std::span(reinterpret_cast<std::uint8_t*>(record.data()), f.code_bytes(x.size())),
           std::span<float>(scales));
  if (!scales.empty())  // (an empty piece's record may have no storage)
    std::memcpy(record.data() + cw, scales.data(), scales.size() * sizeof(float));
}

// A record of out.size() values -> out (Add: acc += them, in fp32).
template <bool Add = false, class T>
void unpack(const Format& f, std::span<const std::int32_t> record, std::span<T> out) {
  const std::size_t n = out.size(), cw = code_words(f, n);
  ZP_EXPECT(record.size() == record_words(f, n), "dequantize: a record of ", n, " values takes ",
            record_words(f, n), " words, got ", record.size());
  std::vector<float>& scales = detail::scale_scratch(f.blocks(n));
  if (!scales.empty())
    std::memcpy(scales.data(), record.data() + cw, scales.size() * sizeof(float));
  const auto codes =
      std::span(reinterpret_cast<const std::uint8_t*>(record.data()), f.code_bytes(n));
  if constexpr (Add)
    dequantize_add(f, codes, std::span<const float>(scales), out);
  else
    dequantize(f, codes, std::span<const float>(scales), out);
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

// qgZ's two-hop reduce-scatter (see the top of this file), through caller-owned scratch of at
// least reduce_scratch()'s sizes. Host memory; blocking.
template <Backend B, class T>
void reduce_scatter(Collective<B>& node, Collective<B>& peers, std::span<const T> in,
                    std::span<float> out, const Format& f, std::span<std::int32_t> send,
                    std::span<std::int32_t> recv, std::span<float> partial) {
  f.check();
  const std::size_t h = std::size_t(node.size()), nodes = std::size_t(peers.size()),
                    ranks = h * nodes, piece = out.size(), rw = record_words(f, piece);
  ZP_EXPECT(in.size() == ranks * piece, "quantized reduce_scatter: ", in.size(), " values in for ",
            ranks, " ranks (", nodes, " nodes of ", h, ") of ", piece, " each");
  const ReduceScratchSize need = reduce_scratch(f, ranks, nodes, piece);
  ZP_EXPECT(
      send.size() >= need.records && recv.size() >= need.records && partial.size() >= need.partial,
      "quantized reduce_scatter: scratch of ", send.size(), ", ", recv.size(), " and ",
      partial.size(), " elements, less than ", need.records, " record words and ", need.partial,
      " partial sums");
  send = send.first(need.records);
  recv = recv.first(need.records);
  partial = partial.first(need.partial);
  // Hop 1: block j of the send buffer holds, node by node, the pieces local rank j sums.
  for (std::size_t j = 0; j < h; ++j)
    for (std::size_t n = 0; n < nodes; ++n)
      pack(in.subspan((n * h + j) * piece, piece), f, send.subspan((j * nodes + n) * rw, rw));
  node.all_to_all(std::span<const std::int32_t>(send), recv);
  std::fill(partial.begin(), partial.end(), 0.0f);  // node n's sum of rank n*h+me's piece
  for (std::size_t i = 0; i < h; ++i)
    for (std::size_t n = 0; n < nodes; ++n)
      unpack<true>(f, std::span<const std::int32_t>(recv.subspan((i * nodes + n) * rw, rw)),
                   partial.subspan(n * piece, piece));
  // Hop 2: the partial of node n's piece to node n.
  for (std::size_t n = 0; n < nodes; ++n)
    pack(std::span<const float>(partial.subspan(n * piece, piece)), f, send.subspan(n * rw, rw));
  peers.all_to_all(std::span<const std::int32_t>(send.first(nodes * rw)), recv.first(nodes * rw));
  std::fill(out.begin(), out.end(), 0.0f);
  for (std::size_t n = 0; n < nodes; ++n)
    unpack<true>(f, std::span<const std::int32_t>(recv.subspan(n * rw, rw)), out);
}

// ... with scratch of its own.
template <Backend B, class T>
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
