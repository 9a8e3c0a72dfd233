// zp/param_coordinator.hpp: ZeRO stage 3's parameter coordination. Each rank keeps only its
// pieces of the parameters (Partitioned<T, 3>); a module's full parameters exist only while it
// is used: gathered when a guard needs them, prefetched while the previous module runs,
// released when the last guard on them ends, and the model's value views pointed at them in
// between.
//
// Parameters on NVMe (offload_param: nvme): a module's pieces are read from the swap file before
// its gathers; the read of the module after the prefetched one starts with the prefetch, so it
// runs while the module before it computes (aio transfers move without the caller). On a device
// backend, pieces in host memory (read, or offloaded: offload_param: cpu) are copied up on the
// compute stream into their place in the gather's buffer, which is then gathered in place.
//
// Order: the guards a micro-step enters (all those between two step() calls), recorded. The
// next micro-step, while it enters the same modules in the same order, prefetches the module
// that came next the last time; where it departs from that order, the layout's neighbour (m + 1
// in forward, m - 1 in backward). Before any micro-step has run, the layout's order (forward
// 0 .. M-1, backward M-1 .. 0) stands for the last one. DeepSpeed traces its first step the same
// way. Every rank runs the same guards, so every rank prefetches the same modules.
//
// Budget: at most max_live_params elements of non-persistent modules are gathered at once (default
// twice the largest module, so one module can run while the next is prefetched; prefetching further
// ahead, EngineConfig::prefetch, fills what modules smaller than the largest leave). A module of at
// most persist_threshold elements is persistent: gathered once, it stays until the shards change. A
// prefetch never evicts; a gather evicts unused modules first, those whose backward came latest in
// the order first (backward needs them last), and fails, naming the numbers, when modules in use
// leave no room.
//
// Kept after forward (FSDP2's reshard_after_forward = false for all, DeepSpeed's
// max_reuse_distance for those reused soon): a module stays gathered from its forward guard
// until its backward guard ends, so backward gathers only what the budget (default then: room
// for every kept module) evicted. Module m's reuse distance is what the guards between its last
// forward guard and its backward guard in the order enter, in parameter elements: in the
// layout's order 2 x the elements of the modules after it. A new order chooses again (and
// resizes the default budget).
//
// Quantized weights (ZeRO++'s qwZ): each rank sends its pieces as int8 codes with one fp32 scale
// per block (quantize.hpp) instead of T, and every rank dequantizes every rank's piece, its own
// too, so all ranks compute with the same weights; the shards (and master weights) stay exact.
// A piece travels as one record (quantized_collectives.hpp), so a segment still takes one
// all_gather.
//
// Secondary partition (ZeRO++'s hpZ): with a node group (the ranks of `comm` that share a node,
// `hpz` of them), a module's first gather after the shards change (over all ranks) leaves on each
// rank its 1/hpz of every segment of the gathered T values; later gathers of the module until
// the shards change (backward, further micro-batches) all_gather those inside the node only. The
// values are the same either way (quantized gathers keep the dequantized ones), so results are
// bitwise those without hpZ; a rank keeps 1/hpz of the non-persistent modules (account()).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/partition.hpp"
#include "zp/quantized_collectives.hpp"
#include "zp/step_timer.hpp"
#include "zp/swap.hpp"

namespace zp {

// The order of a micro-step's guards, and from the last micro-step's the module expected next.
// A micro-step of more than `limit` guards (forward passes without step(): evaluation) is not
// recorded, so the record stays bounded and the last training order stands.
class ModuleOrder {
 public:
  struct Entry {
    int module;
    bool backward;
    bool operator==(const Entry&) const = default;
  };

  // Starts from the layout's order of `modules` modules: forward 0 .. M-1, backward M-1 .. 0.
  explicit ModuleOrder(int modules) : limit_(8 * std::size_t(modules)) {
    for (int m = 0; m < modules; ++m) last_.push_back({m, false});
    for (int m = modules - 1; m >= 0; --m) last_.push_back({m, true});
  }

  void entered(int m, bool backward) {
    latest_ = {m, backward};
    following_ = following_ && count_ < last_.size() && last_[count_] == latest_;
    if (++count_ <= limit_) now_.push_back(latest_);
  }
  // The module expected k >= 1 guards after the latest (-1: none): the last micro-step's while
  // this one has entered the same guards, else the layout's (m + k forward, m - k backward).
  int ahead(int k) const {
    if (!following_) return latest_.backward ? latest_.module - k : latest_.module + k;
    const std::size_t i = count_ - 1 + std::size_t(k);
    return i < last_.size() ? last_[i].module : -1;
  }
  // The micro-step ended: its order, if recorded whole, is the next one's prediction. True when
  // that changed it.
  bool end_micro_step() {
    const bool changed = count_ > 0 && count_ <= limit_ && now_ != last_;
    if (changed) now_.swap(last_);
    now_.clear();
    count_ = 0;
    following_ = true;
    return changed;
  }
  std::span<const Entry> last() const noexcept { return last_; }

 private:
  std::vector<Entry> now_, last_;  // this micro-step's guards (the first limit_); the last one's
  std::size_t limit_, count_ = 0;  // guards entered in this micro-step
  Entry latest_{};
  bool following_ = true;  // this micro-step has entered last_'s first count_ guards
};

template <class T, Backend B>
class ParamCoordinator {
  static constexpr MemorySpace S = B::memory;
  using Work = typename Collective<B>::Work;

 public:
  // values: the model's value views, by parameter index; quantized: qwZ's format, or none;
  // modules whose reuse distance is below max_reuse_distance are kept after forward (SIZE_MAX:
  // all). Everything passed must outlive this.
  ParamCoordinator(Collective<B>& comm, const Partitioned<T, 3, S>& part,
                   std::span<View<T>* const> values, std::size_t persist_threshold,
                   std::size_t max_live_params,
                   std::optional<quant::Format> quantized = std::nullopt,
                   Collective<B>* node = nullptr, std::size_t max_reuse_distance = 0)
      : comm_(&comm),
        part_(&part),
        values_(values),
        node_(node && node->size() > 1 ? node : nullptr),
        quant_(quantized),
        mods_(std::size_t(part.layout().module_count())),
        order_(part.layout().module_count()),
        reuse_(max_reuse_distance),
        fixed_cap_(max_live_params) {
    ZP_EXPECT(!node_ || comm.size() % node_->size() == 0,
              "engine: a secondary partition (hpZ) over ", node ? node->size() : 0,
              " ranks needs a group size that divides the ", comm.size(), " ranks");
    if (quant_) {
      quant_->check();
      ZP_EXPECT(quant_->bits == quant::Bits::int8, "engine: quantized weight gathers are int8");
    }
    const Layout& L = part.layout();
    for (int m = 0; m < L.module_count(); ++m)
      mods_[std::size_t(m)].persistent = persists(L.module(m), persist_threshold);
    follow(order_.last());
    read_spare_.reserve(2);  // drop_read() keeps buffers without allocating
    for (int m = 0; m < L.module_count(); ++m)
      ZP_EXPECT(mods_[std::size_t(m)].persistent || L.module(m).size <= cap_, "engine: module ", m,
                " has ", L.module(m).size, " (padded) elements, more than max_live_params = ", cap_,
                "; raise the cap or split the module");
  }

  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;
  ~ParamCoordinator() {
    for (int m = 0; m < int(mods_.size()); ++m) {
      Module& st = mods_[std::size_t(m)];
      st.works.clear();  // gathers in flight read st.read's pieces: they end first
      drop_read(st);     // (which may free its buffer); the kernel must not write into freed ones
      if (T* const base = st.buffer.data()) bind(m, base, nullptr);
    }
  }

  // A guard on module m begins (recorded in the order): its parameters gathered (waiting for a
  // prefetch in flight) and its views bound. Returns the seconds spent waiting.
  double use(int m, bool backward) {
    order_.entered(m, backward);
    Module& st = mods_[std::size_t(m)];
    if (st.state == State::released) {
      const std::size_t need = layout().module(m).size;
      ZP_EXPECT(
          st.persistent || fits(need), "engine: gathering module ", m, " (", need,
          " elements) would exceed max_live_params = ", cap_, " with ", live_,
          " elements gathered by modules still in use; end the previous module's guard first");
      gather(m);
    }
    double waited = 0;
    if (st.state == State::gathering) {
      const auto t = StepTimer::Clock::now();
      for (auto& w : st.works) w.wait();
      waited = StepTimer::seconds(t, StepTimer::Clock::now());
      st.works.clear();
      drop_read(st);  // the gathers read it; they are done
      if (quant_ && !st.from_secondary) dequantize(m);
      if (node_ && !st.persistent && !st.secondary_valid) keep_secondary(m);
      st.state = State::gathered;
      bind(m, st.buffer.data());
    }
    ++st.uses;
    return waited;
  }

  // A guard on module m ended: the last one releases it unless it is persistent (or a forward
  // guard's, kept for backward).
  void unuse(int m, bool backward) {
    Module& st = mods_[std::size_t(m)];
    if (--st.uses == 0 && !st.persistent && (backward || !st.kept)) release(m);
  }

  // Whether module m stays gathered from its forward guard to its backward guard.
  bool keeps_after_forward(int m) const {
    ZP_EXPECT(m >= 0 && m < int(mods_.size()), "engine: module ", m, " is not one of the model's ",
              mods_.size(), " modules [0, ", mods_.size(), ")");
    return mods_[std::size_t(m)].kept;
  }

  // Walks the modules of the guards expected after the last use(), in order, starting the
  // gather of each released one, until the modules walked hold `elements` (DeepSpeed's
  // stage3_prefetch_bucket_size; 1: the next guard's module only) or one does not fit the
  // budget without evicting (so modules arrive in the order they are used). With parameters on
  // NVMe one module (its gather waits for its read), and the read of the next one starts.
  void prefetch(std::size_t elements) {
    std::size_t walked = 0;
    bool started = false;
    int k = 1;
    while (walked < elements) {
      const int m = order_.ahead(k);
      if (m < 0 || m >= layout().module_count()) break;
      const Module& st = mods_[std::size_t(m)];
      if (st.state == State::released) {
        if (!st.persistent && live_ + layout().module(m).size > cap_) break;
        gather(m);
        started = true;
      }
      walked += layout().module(m).size;
      ++k;
      if (part_->param_swap()) break;
    }
    if (started) read_ahead(order_.ahead(k));
  }

  // step(): the micro-step's guards have all ended. Its order predicts the next micro-step's;
  // where it differs from the last one, the kept modules, the eviction order and the default
  // budget follow it.
  void end_micro_step() {
    if (order_.end_micro_step()) follow(order_.last());
  }

  // Drops every gathered copy, read ahead and secondary shard (the shards are about to change,
  // or changed). No module may be in use.
  void release_all() {
    for (int m = 0; m < layout().module_count(); ++m) {
      release(m);
      drop_read(mods_[std::size_t(m)]);
      mods_[std::size_t(m)].secondary_valid = false;
    }
  }

  std::size_t max_live_params() const noexcept { return cap_; }

  // The least a step's gathers will hold at once, in account()'s categories, for the engine's
  // check before it allocates (engine_agreement.hpp): secondary, hpZ's shards over `hpz` ranks
  // of the modules that do not persist (a persistent one stays gathered); persistent, every
  // persistent module; gathered, those and the most (non-persistent: account()'s gathered_peak)
  // the first micro-step's forward holds where its guards run in the layout's order (which the
  // coordinator predicts before any ran): at module m, m, the kept modules before it and what its
  // prefetch (`prefetch` elements ahead, one module with the parameters on NVMe, `one_ahead`)
  // adds without evicting, up to the first gather that evicts. `reuse`: the constructor's
  // max_reuse_distance.
  static MemoryReport least_working_set(const Layout& L, std::size_t persist_threshold,
                                        std::size_t hpz, std::size_t prefetch,
                                        std::size_t max_live_params, std::size_t reuse,
                                        bool one_ahead) {
    MemoryReport r;
    const int M = L.module_count();
    std::vector<bool> persistent(std::size_t(M), false);
    for (int m = 0; m < M; ++m) {
      const auto& mod = L.module(m);
      persistent[std::size_t(m)] = persists(mod, persist_threshold);
      if (persistent[std::size_t(m)]) r.persistent += mod.size * sizeof(T);
      if (hpz > 1 && !persistent[std::size_t(m)]) r.secondary += mod.size / hpz * sizeof(T);
    }
    const std::vector<bool> kept = reuse_of(L, ModuleOrder(M).last(), reuse).kept;
    const std::size_t cap = budget(L, kept, persistent, max_live_params);
    std::size_t most = 0, kept_live = 0;
    for (int m = 0; m < M; ++m) {
      if (persistent[std::size_t(m)]) continue;
      std::size_t live = kept_live + L.module(m).size;
      if (live > cap) {  // its gather evicts: at least m, and what is live after it is not known
        most = std::max(most, L.module(m).size);
        break;
      }
      std::size_t walked = 0;
      for (int j = m + 1; j < M && walked < prefetch; ++j) {
        if (!persistent[std::size_t(j)]) {
          if (live + L.module(j).size > cap) break;
          live += L.module(j).size;
        }
        walked += L.module(j).size;
        if (one_ahead) break;
      }
      most = std::max(most, live);
      if (kept[std::size_t(m)]) kept_live += L.module(m).size;
    }
    r.gathered = r.persistent + most * sizeof(T);
    return r;
  }

  // The gathered working set in r's stage 3 categories.
  void account(MemoryReport& r) const {
    r.gathered = (live_ + persistent_live_) * sizeof(T);
    r.gathered_peak = peak_live_ * sizeof(T);
    r.persistent = persistent_live_ * sizeof(T);
    for (const auto& b : spare_) r.gather_cache += b.bytes();
    for (const auto& b : packed_spare_) r.gather_cache += b.bytes();
    for (const auto& b : read_spare_) r.swap_buffers += b.bytes();
    for (const auto& mod : mods_) {
      r.secondary += mod.secondary.bytes();
      if (mod.read) r.swap_buffers += mod.read->bytes();
    }
  }

 private:
  enum class State : unsigned char { released, gathering, gathered };
  struct Module {
    State state = State::released;
    bool persistent = false, kept = false;  // kept from forward to backward
    int uses = 0;                           // guards on it not ended yet
    Buffer<T, S> buffer;
    // Parameters on NVMe: this rank's pieces read (or being read) from the swap file, the
    // gathers' input
    std::optional<typename Swap<T>::Ahead> read;
    // qwZ: this rank's records (one per segment), then every rank's, segment after segment
    Buffer<std::int32_t, S> packed;
    // hpZ: this rank's 1/hpz of each segment, valid from the first gather until the shards change
    Buffer<T, S> secondary;
    bool secondary_valid = false, from_secondary = false;
    std::vector<Work> works;  // after the buffers: destroyed (so waited for) before them
  };

  // Whether a module stays gathered across its uses (EngineConfig::persist_threshold).
  static bool persists(const Layout::Module& mod, std::size_t threshold) noexcept {
    return mod.used <= threshold;
  }

  // Where in a micro-step's `order` each module's first backward guard comes (-1: none), and
  // whether it is kept from forward to backward: fewer than `reuse` elements entered between.
  struct Reuse {
    std::vector<std::ptrdiff_t> backward_at;
    std::vector<bool> kept;
  };
  static Reuse reuse_of(const Layout& L, std::span<const ModuleOrder::Entry> order,
                        std::size_t reuse) {
    const std::size_t n = std::size_t(L.module_count());
    Reuse r{std::vector<std::ptrdiff_t>(n, -1), std::vector<bool>(n, false)};
    std::vector<std::ptrdiff_t> forward_at(n, -1);
    std::vector<std::size_t> before(order.size() + 1, 0);  // elements the first i entries enter
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto [m, backward] = order[i];
      before[i + 1] = before[i] + L.module(m).used;
      if (!backward) {
        forward_at[std::size_t(m)] = std::ptrdiff_t(i);
      } else if (r.backward_at[std::size_t(m)] < 0) {  // once a micro-step (ModuleTracker)
        r.backward_at[std::size_t(m)] = std::ptrdiff_t(i);
      }
    }
    for (std::size_t m = 0; m < n; ++m) {
      const std::ptrdiff_t f = forward_at[m], b = r.backward_at[m];
      r.kept[m] = f >= 0 && b > f && before[std::size_t(b)] - before[std::size_t(f) + 1] < reuse;
    }
    return r;
  }
  // The live-parameter budget: `fixed` where set, else the kept modules together where that is
  // every non-persistent one, else the larger of them and twice the largest module.
  static std::size_t budget(const Layout& L, const std::vector<bool>& kept,
                            const std::vector<bool>& persistent, std::size_t fixed) {
    if (fixed) return fixed;
    std::size_t largest = 0, all = 0, held = 0;
    for (int m = 0; m < L.module_count(); ++m) {
      if (persistent[std::size_t(m)]) continue;
      largest = std::max(largest, L.module(m).size);
      all += L.module(m).size;
      held += kept[std::size_t(m)] ? L.module(m).size : 0;
    }
    return held == all ? all : std::max(2 * largest, held);
  }

  // qwZ: a piece of n elements as one record (quantized_collectives.hpp).
  std::size_t record_words(std::size_t n) const { return quant::record_words(*quant_, n); }
  // The words of module m's records on this rank (the gathered ones: comm size times as many).
  std::size_t records_words(int m) const {
    std::size_t w = 0;
    const auto& mod = layout().module(m);
    for (int s = mod.first_segment; s < mod.end_segment; ++s)
      w += record_words(layout().segment(s).piece);
    return w;
  }

  const Layout& layout() const noexcept { return part_->layout(); }

  void gather(int m) {
    const auto& mod = layout().module(m);
    Module& st = mods_[std::size_t(m)];
    st.buffer = take(spare_, mod.size, "engine: a gathered module");
    (st.persistent ? persistent_live_ : live_) += mod.size;
    peak_live_ = std::max(peak_live_, live_);
    st.works.clear();
    st.from_secondary = st.secondary_valid;
    st.state = State::gathering;
    if (st.from_secondary) {  // inside the node: each rank's 1/hpz of each segment
      drop_read(st);
      const std::size_t h = std::size_t(node_->size());
      std::size_t at = 0;
      for (int s = mod.first_segment; s < mod.end_segment; ++s) {
        const auto& g = layout().segment(s);
        st.works.push_back(
            node_->all_gather_async(std::span<const T>(st.secondary.span(at, g.size / h)),
                                    st.buffer.span(g.offset - mod.offset, g.size)));
        at += g.size / h;
      }
      return;
    }
    // Parameters on NVMe: the module's pieces, side by side in the shard, read first (unless a
    // read ahead brought them already).
    std::span<const T> staged;
    if (auto* sw = part_->param_swap()) {
      if (!st.read) start_read(m);
      staged = sw->finish(*st.read);
    }
    // A device gathers from device memory: pieces in host memory (offloaded or read) are copied
    // up into their place in the buffer, and gathered there.
    const bool upload =
        S != MemorySpace::host && (part_->param_swap() || part_->on_host(Field::param));
    const std::size_t ranks = std::size_t(comm_->size()), mine = quant_ ? records_words(m) : 0;
    if (quant_) st.packed = take(packed_spare_, (ranks + 1) * mine, "engine: quantized gathers");
    std::size_t local = 0, gathered = mine;  // qwZ: where the segment's records go
    for (int s = mod.first_segment; s < mod.end_segment; ++s) {
      const auto& g = layout().segment(s);
      std::span<const T> piece =
          part_->param_swap()
              ? staged.subspan(g.shard_offset - layout().segment(mod.first_segment).shard_offset,
                               g.piece)
              : std::span<const T>(part_->template owned<Field::param>(s, Extent::piece).span);
      const std::span<T> out = st.buffer.span(g.offset - mod.offset, g.size);
      if (upload) {
        const std::span<T> place = out.subspan(std::size_t(comm_->rank()) * g.piece, g.piece);
        Memory<S>::from_host(place, piece);
        piece = place;
      }
      if (!quant_) {
        st.works.push_back(upload ? comm_->all_gather_async(out)
                                  : comm_->all_gather_async(piece, out));
        continue;
      }
      const std::size_t words = record_words(g.piece);
      const std::span<std::int32_t> record = st.packed.span(local, words);
      quant::pack<S>(piece, *quant_, record);
      st.works.push_back(comm_->all_gather_async(std::span<const std::int32_t>(record),
                                                 st.packed.span(gathered, ranks * words)));
      local += words;
      gathered += ranks * words;
    }
  }

  // hpZ: module m gathered (from all ranks): this rank's 1/hpz of each segment kept.
  void keep_secondary(int m) {
    Module& st = mods_[std::size_t(m)];
    const auto& mod = layout().module(m);
    const std::size_t h = std::size_t(node_->size()), l = std::size_t(node_->rank());
    if (st.secondary.size() != mod.size / h)
      st.secondary = Buffer<T, S>(mod.size / h, "engine: a module's secondary shard (hpZ)");
    std::size_t at = 0;
    for (int s = mod.first_segment; s < mod.end_segment; ++s) {
      const auto& g = layout().segment(s);
      Memory<S>::copy(
          st.secondary.span(at, g.size / h),
          std::span<const T>(st.buffer.span(g.offset - mod.offset + l * (g.size / h), g.size / h)));
      at += g.size / h;
    }
    st.secondary_valid = true;
  }

  // qwZ: module m's gathered records (its gathers done) -> its buffer, every rank's piece.
  void dequantize(int m) {
    Module& st = mods_[std::size_t(m)];
    const auto& mod = layout().module(m);
    std::size_t at = records_words(m);
    for (int s = mod.first_segment; s < mod.end_segment; ++s) {
      const auto& g = layout().segment(s);
      const std::size_t words = record_words(g.piece);
      for (int r = 0; r < comm_->size(); ++r, at += words)
        quant::unpack<false, S>(
            *quant_, std::span<const std::int32_t>(st.packed.span(at, words)),
            st.buffer.span(g.offset - mod.offset + std::size_t(r) * g.piece, g.piece));
    }
    keep(packed_spare_, std::move(st.packed));
  }

  // Makes room for `need` more live elements by releasing gathered modules nobody uses.
  bool fits(std::size_t need) {
    for (std::size_t i = 0; i < evict_.size() && live_ + need > cap_; ++i) {
      const int m = evict_[i];
      const Module& st = mods_[std::size_t(m)];
      if (!st.persistent && st.uses == 0 && st.state != State::released) release(m);
    }
    return live_ + need <= cap_;
  }

  // Chooses, from a micro-step's order, the modules kept after forward (reuse distance below
  // reuse_), the eviction order (modules backward needs last first: those it never entered,
  // then by backward guard, latest first) and the default budget (the kept modules held
  // together, else a module and its prefetch).
  void follow(std::span<const ModuleOrder::Entry> order) {
    const Layout& L = layout();
    const std::size_t n = std::size_t(L.module_count());
    const auto [backward_at, kept] = reuse_of(L, order, reuse_);
    std::vector<bool> persistent(n);
    for (std::size_t m = 0; m < n; ++m) {
      mods_[m].kept = kept[m];
      persistent[m] = mods_[m].persistent;
    }
    cap_ = budget(L, kept, persistent, fixed_cap_);
    evict_.resize(n);
    std::iota(evict_.begin(), evict_.end(), 0);
    std::stable_sort(evict_.begin(), evict_.end(), [&](int a, int b) {
      const auto at = [&](int m) {  // never entered in backward: first
        const std::ptrdiff_t i = backward_at[std::size_t(m)];
        return i < 0 ? PTRDIFF_MAX : i;
      };
      return at(a) > at(b);
    });
  }

  void release(int m) {
    Module& st = mods_[std::size_t(m)];
    if (st.state == State::released) return;
    for (auto& w : st.works) w.wait();  // an in-flight gather still writes the buffer
    st.works.clear();
    drop_read(st);
    keep(packed_spare_, std::move(st.packed));
    bind(m, nullptr);
    (st.persistent ? persistent_live_ : live_) -= layout().module(m).size;
    keep(spare_, std::move(st.buffer));
    st.state = State::released;
  }

  // Parameters on NVMe: starts reading module m's pieces.
  void start_read(int m) {
    Module& st = mods_[std::size_t(m)];
    if (read_spare_.empty())
      st.read.emplace();
    else
      st.read.emplace(std::move(read_spare_.back())), read_spare_.pop_back();
    const auto& mod = layout().module(m);
    part_->read_param_pieces(mod.first_segment, mod.end_segment, *st.read);
  }
  // Starts reading module m's pieces if it exists and would be gathered from the swap file next.
  void read_ahead(int m) {
    if (!part_->param_swap() || m < 0 || m >= layout().module_count()) return;
    const Module& st = mods_[std::size_t(m)];
    if (st.state == State::released && !st.read && !st.secondary_valid) start_read(m);
  }
  // Ends the read of st's pieces (waited for), its buffer kept for the next (at most 2).
  void drop_read(Module& st) noexcept {
    if (!st.read) return;
    part_->param_swap()->drop(*st.read);
    keep(read_spare_, std::move(*st.read));
    st.read.reset();
  }

  // Released buffers kept for the next gathers (at most 2 a pool): re-allocating them every time
  // costs page faults (host) or allocator calls (device) on every module of every step.
  template <class V>
  static void keep(std::vector<V>& pool, V&& b) {
    if (b.bytes() > 0 && pool.size() < 2) pool.push_back(std::move(b));
    b = V();
  }

  template <class U>
  static Buffer<U, S> take(std::vector<Buffer<U, S>>& pool, std::size_t n, const char* what) {
    for (auto& b : pool)
      if (b.size() == n) {
        Buffer<U, S> out = std::move(b);
        b = std::move(pool.back());
        pool.pop_back();
        return out;
      }
    if (pool.size() >= 2) pool.erase(pool.begin());  // sizes that do not match: drop the oldest
    return Buffer<U, S>(n, what);
  }

  void bind(int m, T* base) { bind(m, nullptr, base); }
  // Points module m's views into `base` (a gathered copy, or nothing); with `only_from`, only
  // the views that point into that copy now (another engine's binding stays).
  void bind(int m, const T* only_from, T* base) {
    const Layout& L = layout();
    const auto& mod = L.module(m);
    for (int s = mod.first_segment; s < mod.end_segment; ++s)
      for (int p : L.segment(s).params) {
        const std::size_t at = L.params()[std::size_t(p)].offset - mod.offset;
        View<T>& v = *values_[std::size_t(p)];
        if (!only_from || v.data() == only_from + at) v.rebind(base ? base + at : nullptr);
      }
  }

  Collective<B>* comm_;
  const Partitioned<T, 3, S>* part_;
  std::span<View<T>* const> values_;
  std::vector<Buffer<T, S>> spare_;                    // released gather buffers kept for reuse
  std::vector<typename Swap<T>::Ahead> read_spare_;    // ... and NVMe read buffers
  std::vector<Buffer<std::int32_t, S>> packed_spare_;  // ... and qwZ's records
  Collective<B>* node_;                                // hpZ's node group, or null
  std::optional<quant::Format> quant_;
  std::vector<Module> mods_;  // after the pools: its in-flight gathers end first
  ModuleOrder order_;
  std::vector<int> evict_;         // modules in the order fits() releases them
  std::size_t reuse_, fixed_cap_;  // max_reuse_distance, max_live_params as configured
  std::size_t cap_ = 0, live_ = 0, persistent_live_ = 0, peak_live_ = 0;
};

}  // namespace zp
