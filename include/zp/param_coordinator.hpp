// zp/param_coordinator.hpp: ZeRO stage 3's parameter coordination. Each rank keeps only its
// pieces of the parameters (Partitioned<T, 3>); a module's full parameters exist only while it
// is used: gathered when a guard needs them, prefetched while the previous module runs,
// released when the last guard on them ends, and the model's value views pointed at them in
// between.
//
// Budget: at most max_live_params elements of non-persistent modules are gathered at once
// (default twice the largest module, so one module can run while the next is prefetched). A
// module of at most persist_threshold elements is persistent: gathered once, it stays until the
// shards change. A prefetch never evicts; a gather evicts unused modules first, and fails,
// naming the numbers, when modules in use leave no room.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/partition.hpp"
#include "zp/step_timer.hpp"

namespace zp {

template <class T, Backend B>
class ParamCoordinator {
  static constexpr MemorySpace S = B::memory;
  using Work = typename Collective<B>::Work;

 public:
  // values: the model's value views, by parameter index. Everything passed must outlive this.
  ParamCoordinator(Collective<B>& comm, const Partitioned<T, 3, S>& part,
                   std::span<View<T>* const> values, std::size_t persist_threshold,
                   std::size_t max_live_params)
      : comm_(&comm),
        part_(&part),
        values_(values),
        mods_(std::size_t(part.layout().module_count())) {
    const Layout& L = part.layout();
    std::size_t largest = 0;
    for (int m = 0; m < L.module_count(); ++m) {
      mods_[std::size_t(m)].persistent = L.module(m).used <= persist_threshold;
      if (!mods_[std::size_t(m)].persistent) largest = std::max(largest, L.module(m).size);
    }
    cap_ = max_live_params ? max_live_params : 2 * largest;
    for (int m = 0; m < L.module_count(); ++m)
      ZP_EXPECT(mods_[std::size_t(m)].persistent || L.module(m).size <= cap_, "engine: module ", m,
                " has ", L.module(m).size, " (padded) elements, more than max_live_params = ", cap_,
                "; raise the cap or split the module");
  }

  // A guard on module m begins: its parameters gathered (waiting for a prefetch in flight) and
  // its views bound. Returns the seconds spent waiting.
  double use(int m) {
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
      keep(staged_spare_, std::move(st.staged));  // the gathers read it; they are done
      st.state = State::gathered;
      bind(m, st.buffer.data());
    }
    ++st.uses;
    return waited;
  }

  // A guard on module m ended: the last one releases it unless it is persistent.
  void unuse(int m) {
    Module& st = mods_[std::size_t(m)];
    if (--st.uses == 0 && !st.persistent) release(m);
  }

  // Starts gathering module m if it exists, is released and fits without evicting anything.
  void prefetch(int m) {
    if (m < 0 || m >= layout().module_count()) return;
    const Module& st = mods_[std::size_t(m)];
    if (st.state != State::released) return;
    if (!st.persistent && live_ + layout().module(m).size > cap_) return;
    gather(m);
  }

  // Drops every gathered copy (the shards are about to change, or changed). No module may be in use.
  void release_all() {
    for (int m = 0; m < layout().module_count(); ++m) release(m);
  }

  std::size_t max_live_params() const noexcept { return cap_; }

  // The gathered working set in r's stage 3 categories.
  void account(MemoryReport& r) const {
    r.gathered = (live_ + persistent_live_) * sizeof(T);
    r.gathered_peak = peak_live_ * sizeof(T);
    r.persistent = persistent_live_ * sizeof(T);
    for (const auto& b : spare_) r.gather_cache += b.bytes();
    for (const auto& b : staged_spare_) r.gather_cache += b.bytes();
  }

 private:
  enum class State : unsigned char { released, gathering, gathered };
  struct Module {
    State state = State::released;
    bool persistent = false;
    int uses = 0;  // guards on it not ended yet
    Buffer<T, S> buffer;
    Buffer<T, S> staged;      // parameters on NVMe: this rank's pieces, the gathers' input
    std::vector<Work> works;  // after the buffers: destroyed (so waited for) before them
  };

  const Layout& layout() const noexcept { return part_->layout(); }

  void gather(int m) {
    const auto& mod = layout().module(m);
    Module& st = mods_[std::size_t(m)];
    st.buffer = take(spare_, mod.size, "engine: a gathered module");
    (st.persistent ? persistent_live_ : live_) += mod.size;
    peak_live_ = std::max(peak_live_, live_);
    st.works.clear();
    // Parameters on NVMe: the module's pieces, side by side in the shard, read first.
    std::size_t staged = 0;
    if (part_->param_swap()) {
      std::size_t n = 0;
      for (int s = mod.first_segment; s < mod.end_segment; ++s) n += layout().segment(s).piece;
      st.staged = take(staged_spare_, n, "engine: a module's parameter pieces read from NVMe");
      part_->read_param_pieces(mod.first_segment, mod.end_segment, st.staged.span());
    }
    for (int s = mod.first_segment; s < mod.end_segment; ++s) {
      const auto& g = layout().segment(s);
      const std::span<const T> piece =
          part_->param_swap()
              ? std::span<const T>(st.staged.span(std::exchange(staged, staged + g.piece), g.piece))
              : std::span<const T>(part_->template owned<Field::param>(s, Extent::piece).span);
      st.works.push_back(
          comm_->all_gather_async(piece, st.buffer.span(g.offset - mod.offset, g.size)));
    }
    st.state = State::gathering;
  }

  // Makes room for `need` more live elements by releasing gathered modules nobody uses.
  bool fits(std::size_t need) {
    for (int m = 0; m < layout().module_count() && live_ + need > cap_; ++m) {
      const Module& st = mods_[std::size_t(m)];
      if (!st.persistent && st.uses == 0 && st.state != State::released) release(m);
    }
    return live_ + need <= cap_;
  }

  void release(int m) {
    Module& st = mods_[std::size_t(m)];
    if (st.state == State::released) return;
    for (auto& w : st.works) w.wait();  // an in-flight gather still writes the buffer
    st.works.clear();
    keep(staged_spare_, std::move(st.staged));
    bind(m, nullptr);
    (st.persistent ? persistent_live_ : live_) -= layout().module(m).size;
    keep(spare_, std::move(st.buffer));
    st.state = State::released;
  }

  // Released buffers kept for the next gathers (at most 2 a pool): re-allocating them every time
  // costs page faults (host) or allocator calls (device) on every module of every step.
  static void keep(std::vector<Buffer<T, S>>& pool, Buffer<T, S>&& b) {
    if (b.size() > 0 && pool.size() < 2) pool.push_back(std::move(b));
    b = Buffer<T, S>();
  }

  static Buffer<T, S> take(std::vector<Buffer<T, S>>& pool, std::size_t n, const char* what) {
    for (auto& b : pool)
      if (b.size() == n) {
        Buffer<T, S> out = std::move(b);
        b = std::move(pool.back());
        pool.pop_back();
        return out;
      }
    if (pool.size() >= 2) pool.erase(pool.begin());  // sizes that do not match: drop the oldest
    return Buffer<T, S>(n, what);
  }

  void bind(int m, T* base) {
    const Layout& L = layout();
    const auto& mod = L.module(m);
    for (int s = mod.first_segment; s < mod.end_segment; ++s)
      for (int p : L.segment(s).params)
        values_[std::size_t(p)]->rebind(
            base ? base + (L.params()[std::size_t(p)].offset - mod.offset) : nullptr);
  }

  Collective<B>* comm_;
  const Partitioned<T, 3, S>* part_;
  std::span<View<T>* const> values_;
  std::vector<Buffer<T, S>> spare_;         // released gather buffers kept for reuse
  std::vector<Buffer<T, S>> staged_spare_;  // ... and released NVMe staging buffers
  std::vector<Module> mods_;                // after the pools: its in-flight gathers end first
  std::size_t cap_ = 0, live_ = 0, persistent_live_ = 0, peak_live_ = 0;
};

}  // namespace zp
