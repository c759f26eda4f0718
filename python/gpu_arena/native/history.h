// history.h: torch's own memory history on gpu-arena's native torch allocator. Included once,
// by allocator.cpp, after torch's headers, GA_TORCH_AT_LEAST and gpu_arena_api.h (PoolBlock).
//
// torch.cuda.memory._record_memory_history() calls CUDAAllocator::recordHistory; _snapshot()
// and _dump_snapshot() then read SnapshotInfo.device_traces (a TraceEntry per event, with
// the GatheredContext torch's recorder made: Python and C++ stacks), each block's and
// segment's context_when_allocated and external_annotations: what PyTorch's memory_viz
// draws. History keeps them as CUDACachingAllocator does (its recordHistory,
// maybeGatherContext, record_trace and snapshot):
// - a ring of TraceEntry per device, alloc_trace_max_entries long (the oldest overwritten),
//   emptied by recordHistory(false) and by clearHistory; skip_actions (2.11+) stay out of
//   it; times are approximate clock readings, made microseconds since the epoch when read;
// - RecordContext: STATE gathers a context for each allocation (kept with the live block,
//   shown by snapshot()); ALLOC puts it in the alloc trace entries too; ALL also gathers
//   one for each free and empty_cache. Gathered outside any lock (the recorder may take
//   Python's GIL), never while neither history nor a tracker is on;
// - AllocatorTraceTracker callbacks get every entry, history on or not (skip_actions too),
//   under History's lock (as torch calls them under its device lock: they must not call
//   into Python);
// - the compile context stack, user metadata (2.10+) and annotations are recorded as torch's.
//
// The allocator's hot path, while neither history nor a tracker is on, costs one relaxed
// atomic load (active()): no lock, no map. While on, every allocation and free takes
// History's lock and updates a map of live blocks.
//
// What differs from CUDACachingAllocator (approximate, or missing):
// - free_requested and free_completed are recorded together, when torch frees the block:
//   gpu-arena holds back a block used on other streams (record_stream) until their work is
//   done, inside gpu-arena, where the allocator does not see it end.
// - segment_alloc / segment_free are gpu-arena's arenas (the snapshot's segments), exact in
//   address, size and order: gpu-arena's arena observer (gpu_arena_observe_arenas) reports
//   each arena mapped before any of it is handed out and each one released before it goes,
//   on the thread that caused it. An arena made or released outside this allocator (the
//   gpu_arena Python API, another thread's gpu_arena.empty_cache) has no stream, pool or
//   context. A libgpu_arena without the observer gives no segment entries. segment_map and
//   segment_unmap never appear (an arena is mapped whole).
// - A block allocated before recording started: its free entries have the requested size
//   gpu_arena_allocation_of gives, no stream, pool or context.
// - Once history is off and no tracker is attached, the live blocks' contexts are dropped
//   (torch keeps them until each block is freed): take the snapshot before turning it off.
// - setCheckpointPoolState records only what changes (frees of blocks not checkpointed,
//   allocs of checkpointed blocks not live); torch's frees and re-allocates every block.
// - An oom entry's size is the bytes asked for (torch's: its rounded size). Snapshot
//   segments have no stream (SegmentInfo.stream stays 0).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace gpu_arena_native {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using Ctx = std::shared_ptr<c10::GatheredContext>;
using Action = cca::TraceEntry::Action;
// c10::cuda::CUDACachingAllocator's until 2.10, c10::CachingDeviceAllocator's since.
using Annotation = decltype(cca::SnapshotInfo::external_annotations)::value_type;

// gpu_arena_arena_info_t, as the arena observer's callbacks get it.
struct ArenaInfo {
  int32_t device;
  uint32_t flags;
  uint64_t arena_id;
  void* base;
  size_t size;
};
using ArenaFn = int (*)(const ArenaInfo*, void*);
using ObserveFn = int (*)(ArenaFn, ArenaFn, void*, uint64_t*);
using UnobserveFn = int (*)(uint64_t);
using AllocationOfFn = int (*)(const void*, void**, size_t*, int*);

// What History knows of a live block.
struct LiveBlock {
  c10::DeviceIndex dev = 0;
  size_t requested = 0;
  cudaStream_t stream = nullptr;
  c10::cuda::MempoolId_t pool{0, 0};
  Ctx ctx;
};

// The allocation (or empty_cache) under way on this thread while tracing: the arena
// observer's segment entries take its stream, pool and context.
struct Pending {
  cudaStream_t stream = nullptr;
  c10::cuda::MempoolId_t pool{0, 0};
  Ctx ctx;
};
thread_local Pending* t_pending = nullptr;
thread_local bool t_quiet = false;  // set while observe/unobserve deliver on this thread

class PendingScope {
 public:
  explicit PendingScope(Pending* p) : prev_(t_pending) { t_pending = p; }
  ~PendingScope() { t_pending = prev_; }
  PendingScope(const PendingScope&) = delete;
  PendingScope& operator=(const PendingScope&) = delete;

 private:
  Pending* prev_;
};

inline uint64_t addr_of(const void* p) { return reinterpret_cast<uint64_t>(p); }

// CUDACachingAllocator's RingBuffer: the newest `max` entries, oldest first when read.
template <class T>
class Ring {
 public:
  explicit Ring(size_t max) : max_(std::max<size_t>(max, 1)) {}
  void set_max(size_t max) {
    max = std::max<size_t>(max, 1);
    if (next_ != 0 || max < v_.size()) {  // linearize, oldest first, keep the newest
      std::vector<T> keep;
      append_to(keep);
      if (keep.size() > max) {
        keep.erase(keep.begin(), keep.end() - static_cast<ptrdiff_t>(max));
      }
      v_ = std::move(keep);
      next_ = 0;
    }
    max_ = max;
  }
  void push(T e) {
    if (v_.size() < max_) {
      v_.push_back(std::move(e));
    } else {
      v_[next_] = std::move(e);
      next_ = (next_ + 1) % max_;
    }
  }
  void clear() {
    v_.clear();
    next_ = 0;
  }
  void append_to(std::vector<T>& out) const {
    out.insert(out.end(), v_.begin() + static_cast<ptrdiff_t>(next_), v_.end());
    out.insert(out.end(), v_.begin(), v_.begin() + static_cast<ptrdiff_t>(next_));
  }

 private:
  std::vector<T> v_;
  size_t next_ = 0;
  size_t max_;
};

// TraceEntry's constructor: user_metadata since 2.10; its stream a void* since 2.11 (a
// cudaStream_t converts).
inline cca::TraceEntry make_entry(Action a, c10::DeviceIndex dev, uint64_t addr, size_t size,
                                  cudaStream_t stream, c10::cuda::MempoolId_t pool, Ctx ctx,
                                  const std::string& compile, const std::string& user) {
#if GA_TORCH_AT_LEAST(2, 10)
  return cca::TraceEntry(a, dev, static_cast<size_t>(addr), size, stream, pool,
                         c10::getApproximateTime(), std::move(ctx), compile, user);
#else
  (void)user;
  return cca::TraceEntry(a, dev, static_cast<size_t>(addr), size, stream, pool,
                         c10::getApproximateTime(), std::move(ctx), compile);
#endif
}

class History {
 public:
  // The allocator's one check on its hot path: history or a trace tracker is on.
  bool active() const { return active_.load(std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // The arena observer of the libgpu_arena at `path` (already loaded; without it, no
  // segment entries) and its gpu_arena_allocation_of.
  void bind(const std::string& path, AllocationOfFn allocation_of) {
    allocation_of_ = allocation_of;
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) return;
    observe_ = reinterpret_cast<ObserveFn>(dlsym(h, "gpu_arena_observe_arenas"));
    unobserve_ = reinterpret_cast<UnobserveFn>(dlsym(h, "gpu_arena_unobserve_arenas"));
  }

  // CUDAAllocator::recordHistory. Unknown skip_actions are ignored, as torch's.
  void set(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
           cca::RecordContext when, bool clear, const std::vector<std::string>& skip) {
    TORCH_CHECK(when == cca::RecordContext::NEVER || recorder != nullptr,
                "recordHistory: recording contexts needs a context recorder");
    static const std::pair<const char*, Action> kNames[] = {
        {"alloc", Action::ALLOC},
        {"free_requested", Action::FREE_REQUESTED},
        {"free_completed", Action::FREE_COMPLETED},
        {"segment_alloc", Action::SEGMENT_ALLOC},
        {"segment_free", Action::SEGMENT_FREE},
        {"segment_map", Action::SEGMENT_MAP},
        {"segment_unmap", Action::SEGMENT_UNMAP},
        {"snapshot", Action::SNAPSHOT},
        {"oom", Action::OOM}};
    std::set<int> skips;
    for (const std::string& s : skip) {
      for (const auto& n : kNames) {
        if (s == n.first) skips.insert(static_cast<int>(n.second));
      }
    }
    std::lock_guard<std::mutex> reg(observer_mu_);
    bool active = enabled;
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      active = active || !trackers_.empty();
    }
    if (active) start_observing();  // before any allocation is traced
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      recorder_.store(enabled ? recorder : nullptr, std::memory_order_release);
      when_.store(enabled ? static_cast<int>(when) : 0, std::memory_order_release);
      max_ = std::max<size_t>(max_entries, 1);
      for (auto& r : rings_) r.set_max(max_);
      annotations_.set_max(max_);
      if (!enabled || clear) {
        for (auto& r : rings_) r.clear();
        annotations_.clear();
      }
      skip_ = std::move(skips);
      recording_ = enabled;
      enabled_.store(enabled, std::memory_order_relaxed);
      active_.store(active, std::memory_order_release);
      if (!active) {
        blocks_.clear();
        segments_.clear();
      }
    }
    if (!active) stop_observing();
  }

  void add_tracker(cca::AllocatorTraceTracker tracker) {
    std::lock_guard<std::mutex> reg(observer_mu_);
    start_observing();
    std::lock_guard<std::recursive_mutex> g(mu_);
    trackers_.push_back(std::move(tracker));
    active_.store(true, std::memory_order_release);
  }

  // maybeGatherContext: a context when recording at `level` or above.
  Ctx gather(cca::RecordContext level) const {
    if (when_.load(std::memory_order_acquire) < static_cast<int>(level)) return nullptr;
    cca::CreateContextFn fn = recorder_.load(std::memory_order_acquire);
    return fn != nullptr ? fn() : nullptr;
  }

  void alloc_event(void* p, size_t n, c10::DeviceIndex dev, const Pending& pd) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (!active()) return;
    blocks_[addr_of(p)] = LiveBlock{dev, n, pd.stream, pd.pool, pd.ctx};
    record(Action::ALLOC, dev, addr_of(p), n, pd.stream, pd.pool, pd.ctx);
  }
  // free_requested and free_completed for `p`; `fallback` describes a block not known here
  // (allocated before tracing). false when neither knows it (nothing recorded).
  bool free_event(void* p, const Ctx& ctx, const LiveBlock* fallback) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (!active()) return true;
    LiveBlock b;
    auto it = blocks_.find(addr_of(p));
    if (it != blocks_.end()) {
      b = std::move(it->second);
      blocks_.erase(it);
    } else if (fallback != nullptr) {
      b = *fallback;
    } else {
      return false;
    }
    const Ctx& c = ctx ? ctx : b.ctx;
    record(Action::FREE_REQUESTED, b.dev, addr_of(p), b.requested, b.stream, b.pool, c);
    record(Action::FREE_COMPLETED, b.dev, addr_of(p), b.requested, b.stream, b.pool, c);
    return true;
  }
  // The allocator's free while tracing, before gpu-arena frees `p` (so that its address
  // cannot be handed out again before these entries are recorded). A deleter must not
  // throw: only raw_delete (throw_on_error) does.
  void free_traced(void* p, bool throw_on_error) {
    try {
      const Ctx ctx = gather(cca::RecordContext::ALL);
      if (free_event(p, ctx, nullptr) || allocation_of_ == nullptr) return;
      void* base = nullptr;  // allocated before tracing: what gpu-arena knows of it
      LiveBlock b;
      int dev = 0;
      if (allocation_of_(p, &base, &b.requested, &dev) != 0 || base != p) return;
      b.dev = static_cast<c10::DeviceIndex>(dev);
      free_event(p, ctx, &b);
    } catch (const std::exception& e) {
      if (throw_on_error) throw;
      TORCH_WARN("gpu-arena: memory history: ", e.what());
    }
  }
  // setCheckpointPoolState's changes to pool `id`: frees of the blocks live `before` and not
  // `kept`, allocs of the checkpointed blocks (`after`) not live before. (torch's frees every
  // block and allocates every checkpointed one; gpu-arena leaves the others alone.)
  void restore_event(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                     const std::vector<PoolBlock>& before, const std::vector<PoolBlock>& after,
                     const std::unordered_set<uint64_t>& kept) {
    const Ctx free_ctx = gather(cca::RecordContext::ALL);
    std::unordered_set<uint64_t> live;
    for (const PoolBlock& b : before) {
      live.insert(b.ptr);
      if (kept.count(b.ptr) != 0) continue;
      LiveBlock lb{dev, b.requested, static_cast<cudaStream_t>(b.stream), id, nullptr};
      free_event(reinterpret_cast<void*>(b.ptr), free_ctx, &lb);
    }
    Pending pd;
    pd.pool = id;
    pd.ctx = gather(cca::RecordContext::STATE);
    for (const PoolBlock& b : after) {
      if (live.count(b.ptr) != 0) continue;
      pd.stream = static_cast<cudaStream_t>(b.stream);
      alloc_event(reinterpret_cast<void*>(b.ptr), b.requested, dev, pd);
    }
  }
  // addr_ of an OOM entry is the device's free bytes, as torch's.
  void oom_event(c10::DeviceIndex dev, size_t free_bytes, size_t n, const Pending& pd) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (active()) record(Action::OOM, dev, free_bytes, n, pd.stream, pd.pool, pd.ctx);
  }

  void annotate(c10::DeviceIndex dev,
                const std::vector<std::pair<std::string, std::string>>& md) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (!recording_) return;
    Annotation ae(dev, c10::getApproximateTime());
    for (const auto& kv : md) ae.recordUserMetadata(kv.first, kv.second);
    annotations_.push(std::move(ae));
  }
  void push_compile_context(const std::string& md) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    compile_.push_back(md);
  }
  void pop_compile_context() {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (!compile_.empty()) compile_.pop_back();
  }
  void set_user_metadata(const std::string& md) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    user_metadata_ = md;
  }
  std::string user_metadata() {
    std::lock_guard<std::recursive_mutex> g(mu_);
    return user_metadata_;
  }
  // The context of the live block starting at `p` (getContextForPointer).
  Ctx context_of(const void* p) {
    std::lock_guard<std::recursive_mutex> g(mu_);
    auto it = blocks_.find(addr_of(p));
    return it != blocks_.end() ? it->second.ctx : nullptr;
  }

  // For snapshot(): while it is held, block_context / segment_context read the maps.
  std::unique_lock<std::recursive_mutex> lock() {
    return std::unique_lock<std::recursive_mutex>(mu_);
  }
  Ctx block_context(uint64_t addr) const {  // lock() held
    auto it = blocks_.find(addr);
    return it != blocks_.end() ? it->second.ctx : nullptr;
  }
  Ctx segment_context(uint64_t addr) const {  // lock() held
    auto it = segments_.find(addr);
    return it != segments_.end() ? it->second.ctx : nullptr;
  }
  // lock() held. device_traces (one list per device, when include_traces) and
  // external_annotations, times made microseconds since the epoch; then, as torch's, a
  // snapshot entry per device (its active bytes), seen by the next snapshot.
  void fill(cca::SnapshotInfo& info, int n_devices, bool include_traces,
            const std::vector<size_t>& active_bytes) {
    auto to_ns = clock_.makeConverter();
    auto to_us = [&](c10::approx_time_t t) { return to_ns(t) / 1000; };
    if (include_traces) {
      info.device_traces.resize(static_cast<size_t>(n_devices));
      for (size_t d = 0; d < info.device_traces.size() && d < rings_.size(); ++d) {
        rings_[d].append_to(info.device_traces[d]);
      }
      for (auto& trace : info.device_traces) {
        for (auto& te : trace) {
          const c10::approx_time_t t = te.time_.approx_t_;
          te.time_.t_ = to_us(t);
        }
      }
    }
    annotations_.append_to(info.external_annotations);
    for (auto& ae : info.external_annotations) {
      const c10::approx_time_t t = ae.time_.approx_t_;
      ae.time_.t_ = to_us(t);
    }
    if (!active()) return;
    for (int d = 0; d < n_devices; ++d) {
      const size_t bytes = static_cast<size_t>(d) < active_bytes.size() ? active_bytes[d] : 0;
      record(Action::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0, bytes, nullptr, {0, 0},
             nullptr);
    }
  }

 private:
  struct SegmentMeta {
    cudaStream_t stream = nullptr;
    c10::cuda::MempoolId_t pool{0, 0};
    Ctx ctx;
  };

  // record_trace; mu_ held.
  void record(Action a, c10::DeviceIndex dev, uint64_t addr, size_t size, cudaStream_t stream,
              c10::cuda::MempoolId_t pool, const Ctx& ctx) {
    const bool keep = recording_ && dev >= 0 && skip_.count(static_cast<int>(a)) == 0;
    if (!keep && trackers_.empty()) return;
    const bool with_ctx =
        when_.load(std::memory_order_relaxed) >= static_cast<int>(cca::RecordContext::ALLOC);
    cca::TraceEntry te =
        make_entry(a, dev, addr, size, stream, pool, with_ctx ? ctx : nullptr,
                   compile_.empty() ? std::string("N/A") : compile_.back(), user_metadata_);
    for (const auto& t : trackers_) t(te);
    if (!keep) return;
    const size_t d = static_cast<size_t>(dev);
    while (rings_.size() <= d) rings_.emplace_back(max_);
    rings_[d].push(std::move(te));
  }

  // The arena observer's callbacks: nothing may cross back into gpu-arena's Rust.
  static int on_ready(const ArenaInfo* a, void* self) {
    static_cast<History*>(self)->arena_event(Action::SEGMENT_ALLOC, a);
    return 0;  // take it: its on_release follows
  }
  static int on_release(const ArenaInfo* a, void* self) {
    static_cast<History*>(self)->arena_event(Action::SEGMENT_FREE, a);
    return 0;
  }
  void arena_event(Action action, const ArenaInfo* a) noexcept {
    if (t_quiet || a == nullptr) return;
    try {
      const Pending none;  // (no function-local statics: deleters may run at exit)
      const Pending& pd = t_pending != nullptr ? *t_pending : none;
      std::lock_guard<std::recursive_mutex> g(mu_);
      if (!active()) return;
      const uint64_t base = addr_of(a->base);
      const auto dev = static_cast<c10::DeviceIndex>(a->device);
      if (action == Action::SEGMENT_ALLOC) {
        segments_[base] = SegmentMeta{pd.stream, pd.pool, pd.ctx};
        record(action, dev, base, a->size, pd.stream, pd.pool, pd.ctx);
        return;
      }
      SegmentMeta m{pd.stream, pd.pool, nullptr};
      auto it = segments_.find(base);
      if (it != segments_.end()) {
        m = std::move(it->second);
        segments_.erase(it);
      }
      record(action, dev, base, a->size, m.stream, m.pool, pd.ctx ? pd.ctx : m.ctx);
    } catch (...) {
    }
  }

  // observer_mu_ held, mu_ not: unobserve waits for callbacks of other threads (which take
  // mu_); the deliveries to this thread (every arena there is) are not events.
  void start_observing() {
    if (observer_ != 0 || observe_ == nullptr) return;
    uint64_t id = 0;
    t_quiet = true;
    const int rc = observe_(&History::on_ready, &History::on_release, this, &id);
    t_quiet = false;
    if (rc == 0) {
      observer_ = id;
    } else {
      TORCH_WARN_ONCE("gpu-arena: memory history records no segment_alloc/segment_free: "
                      "gpu_arena_observe_arenas failed (", rc, ")");
    }
  }
  void stop_observing() {
    if (observer_ == 0) return;
    t_quiet = true;
    unobserve_(observer_);
    t_quiet = false;
    observer_ = 0;
  }

  std::atomic<bool> active_{false};   // recording_ or a tracker
  std::atomic<bool> enabled_{false};  // recording_, for isHistoryEnabled
  std::atomic<int> when_{0};          // RecordContext while recording, else NEVER
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  AllocationOfFn allocation_of_ = nullptr;
  ObserveFn observe_ = nullptr;
  UnobserveFn unobserve_ = nullptr;
  std::mutex observer_mu_;  // serializes set / add_tracker (observer on and off)
  uint64_t observer_ = 0;
  c10::ApproximateClockToUnixTimeConverter clock_;

  std::recursive_mutex mu_;  // trackers may call back into the allocator
  bool recording_ = false;
  size_t max_ = 1;
  std::set<int> skip_;
  std::vector<Ring<cca::TraceEntry>> rings_;  // per device
  Ring<Annotation> annotations_{1};
  std::unordered_map<uint64_t, LiveBlock> blocks_;     // block start -> what it was
  std::unordered_map<uint64_t, SegmentMeta> segments_;  // arena base -> its allocation
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::vector<std::string> compile_;
  std::string user_metadata_;
};

}  // namespace
}  // namespace gpu_arena_native
