// allocator.cpp: gpu-arena as PyTorch's own CUDA allocator. A subclass of
// c10::cuda::CUDACachingAllocator::CUDAAllocator over gpu-arena's C API, compiled at
// gpu_arena.torch install time against the installed torch (gpu_arena/torch_native.py, cached
// per torch build) and installed by gpu_arena_torch_install_native() through
// torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator. Every torch.cuda memory entry
// point (allocation, graph pools and CUDA graphs, cudagraph trees' checkpoints, memory_stats,
// empty_cache, record_stream, torch.multiprocessing's CUDA IPC) then reaches gpu-arena.
//
// Versions: torch 2.8 and newer. Every method is marked `override`, so an interface torch
// reshapes fails the build (and gpu_arena falls back to the pluggable route) instead of
// adding an overload torch never calls. TORCH_VERSION_MAJOR/MINOR bridge the changes of
// 2.8, 2.10, 2.11 and 2.12 (shared/design/TORCH-ALLOCATOR.md §7).
//
// What torch's own allocator does and this one does not (each also noted at its method):
// - Memory history (recordHistory, snapshot()'s traces and stacks): history.h, which says
//   what is approximate there (gpu-arena's own history follows recordHistory's switch too).
// - setUseOnOOM / setNoSplit: accepted, no effect (warned once).
// - cacheInfo: the largest cached block is unknown; the device's free memory stands for it.
#include <torch/version.h>

#define GA_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#if !GA_TORCH_AT_LEAST(2, 8)
#error "gpu-arena's native torch allocator needs torch 2.8 or newer"
#endif

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gpu_arena_api.h"
#include "device_util.h"
#include "history.h"
#include "ipc_shares.h"

#ifdef GPU_ARENA_CHECK_LAYOUT  // torch_native.check_headers(gpu_arena_header=...)
#include <gpu_arena.h>
#define GA_SAME_FIELD(f)                                                            \
  static_assert(offsetof(gpu_arena_native::Stats, f) == offsetof(gpu_arena_stats_t, f), \
                "gpu_arena_stats_t." #f " moved");
// Every field of Stats (the leading fields of gpu_arena_stats_t, up to the last one read).
GA_SAME_FIELD(reserved_bytes)
GA_SAME_FIELD(allocated_bytes)
GA_SAME_FIELD(peak_reserved_bytes)
GA_SAME_FIELD(peak_allocated_bytes)
GA_SAME_FIELD(arenas)
GA_SAME_FIELD(backend_creates)
GA_SAME_FIELD(backend_destroys)
GA_SAME_FIELD(exports_live)
GA_SAME_FIELD(exports_total)
GA_SAME_FIELD(shares_live)
GA_SAME_FIELD(imports_live)
GA_SAME_FIELD(pinned_bytes)
GA_SAME_FIELD(allocations)
GA_SAME_FIELD(alloc_count)
GA_SAME_FIELD(free_count)
GA_SAME_FIELD(oom_count)
GA_SAME_FIELD(deferred_free_bytes)
GA_SAME_FIELD(pending_free_bytes)
GA_SAME_FIELD(requested_bytes)
GA_SAME_FIELD(peak_requested_bytes)
static_assert(sizeof(gpu_arena_native::Share) == sizeof(gpu_arena_share_t), "share size");
static_assert(gpu_arena_native::kShareBytes == GPU_ARENA_SHARE_BYTES, "share bytes");
static_assert(gpu_arena_native::kErrOutOfMemory == GPU_ARENA_ERR_OUT_OF_MEMORY, "OOM code");
static_assert(sizeof(gpu_arena_native::PoolBlock) == sizeof(gpu_arena_pool_block_t), "block");
static_assert(offsetof(gpu_arena_native::Segment, in_graph_pool) ==
                  offsetof(gpu_arena_segment_t, in_graph_pool) &&
              sizeof(gpu_arena_native::Segment) == sizeof(gpu_arena_segment_t), "segment");
static_assert(offsetof(gpu_arena_native::SegmentBlock, allocated) ==
                  offsetof(gpu_arena_segment_block_t, allocated) &&
              sizeof(gpu_arena_native::SegmentBlock) == sizeof(gpu_arena_segment_block_t),
              "segment block");
static_assert(sizeof(gpu_arena_native::StatsBuffer) >= sizeof(gpu_arena_stats_t), "room");
static_assert(offsetof(gpu_arena_native::ArenaInfo, base) ==
                  offsetof(gpu_arena_arena_info_t, base) &&
              sizeof(gpu_arena_native::ArenaInfo) == sizeof(gpu_arena_arena_info_t), "arena");
#endif

namespace gpu_arena_native {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::DataPtr;
using c10::DeviceIndex;
using c10::cuda::MempoolId_t;  // c10::MempoolId_t since 2.9; this alias in every version

#if GA_TORCH_AT_LEAST(2, 11)
using PoolAllocatorArg = std::shared_ptr<cca::CUDAAllocator>;
cca::CUDAAllocator* raw_of(const PoolAllocatorArg& a) { return a.get(); }
#else
using PoolAllocatorArg = cca::CUDAAllocator*;
cca::CUDAAllocator* raw_of(PoolAllocatorArg a) { return a; }
#endif

constexpr int kMaxDevices = 128;
// Our share handles for torch.multiprocessing: this prefix, then the 128 share bytes. Its
// first byte is far above torch's SHAREABLE_HANDLE_VERSION, so a handle reaching a process
// where gpu-arena is not torch's allocator fails loudly there, and ours refuse theirs.
constexpr char kHandleMagic[] = "\xa7gpu-arena/1";
constexpr size_t kHandleMagicLen = sizeof(kHandleMagic) - 1;

Api g_api;  // bound once, by gpu_arena_torch_install_native
class Allocator;
Allocator* g_self = nullptr;  // the installed allocator, never destroyed
void raw_delete_fn(void* ptr);

std::string last_error() { return g_api.last_error(); }

void check_rc(long rc, const char* what) {
  TORCH_CHECK(rc >= 0, "gpu-arena: ", what, " failed: ", last_error());
}

std::string take_string(char* s) {
  std::string out = s != nullptr ? s : "";
  g_api.string_free(s);
  return out;
}

void check_device(DeviceIndex dev) {
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "gpu-arena: device index ", int(dev),
              " out of range");
}

// What getCheckpointState hands torch: the pool's live blocks at that time.
struct Checkpoint : cca::AllocatorState {
  DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::vector<PoolBlock> blocks;
};

class Allocator final : public cca::CUDAAllocator {
 public:
  Allocator() {
    for (auto& f : fraction_) f.store(1.0);
  }

  // ---- allocation (hot path: one atomic load when no pool route is open) ----
  DataPtr allocate(size_t n) override {
    const DeviceIndex dev = c10::cuda::current_device();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
    void* p = n != 0 ? alloc(n, dev, stream) : nullptr;
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, dev)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void* raw_alloc(size_t n) override {
    if (n == 0) return nullptr;
    const DeviceIndex dev = c10::cuda::current_device();
    return alloc(n, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    if (n == 0) return nullptr;
    return alloc(n, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { release(ptr, /*throw_on_error=*/true); }

  // The deleter of every DataPtr this allocator makes (raw_deleter()).
  void release(void* ptr, bool throw_on_error) {
    if (ptr == nullptr) return;
    if (C10_UNLIKELY(history_.active())) history_.free_traced(ptr, throw_on_error);
    drop_share(ptr);
    if (C10_UNLIKELY(g_api.free_unsized(ptr) < 0)) {
      // A deleter must not throw (it runs in destructors): raw_delete does, a deleter warns.
      if (throw_on_error) TORCH_CHECK(false, "gpu-arena: ", last_error());
      TORCH_WARN("gpu-arena: ", last_error());
    }
  }

  // ---- graph pools (CUDA graphs, torch.cuda.MemPool, cudagraph trees) ----
  void beginAllocateToPool(DeviceIndex dev, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(dev);
    long rc;
    {  // It may wait for another thread's empty_cache / sleep / wake / trim, whose observers
       // may be Python callbacks: neither the GIL nor a lock of ours is held meanwhile.
      GilReleased no_gil;
      rc = g_api.graph_pool_begin(dev, id.first, id.second);
    }
    check_rc(rc, "gpu_arena_graph_pool_begin");
    std::lock_guard<std::mutex> g(routes_mu_);
    auto& v = routes_[dev];
    if (std::any_of(v.begin(), v.end(), [&](const Route& r) { return r.id == id; })) {
      g_api.graph_pool_end(dev, id.first, id.second);  // recording to it already: undone
      g_api.graph_pool_release(dev, id.first, id.second);
      TORCH_CHECK(false, "beginAllocateToPool: already recording to mempool_id");
    }
    v.push_back(Route{id, std::move(filter)});
    open_[dev].fetch_add(1, std::memory_order_release);
  }
  void endAllocateToPool(DeviceIndex dev, MempoolId_t id) override {
    check_device(dev);
    std::lock_guard<std::mutex> g(routes_mu_);
    auto& v = routes_[dev];
    auto it = std::find_if(v.begin(), v.end(), [&](const Route& r) { return r.id == id; });
    TORCH_CHECK(it != v.end(), "endAllocatePool: not currently recording to mempool_id");
    v.erase(it);
    open_[dev].fetch_sub(1, std::memory_order_release);
    check_rc(g_api.graph_pool_end(dev, id.first, id.second), "gpu_arena_graph_pool_end");
  }
  void releasePool(DeviceIndex dev, MempoolId_t id) override {
    check_rc(g_api.graph_pool_release(dev, id.first, id.second), "gpu_arena_graph_pool_release");
  }
  void createOrIncrefPool(DeviceIndex dev, MempoolId_t id, PoolAllocatorArg allocator) override {
    cca::CUDAAllocator* other = raw_of(allocator);
    TORCH_CHECK(other == nullptr || other == this,
                "gpu-arena's native torch allocator does not serve a MemPool with another "
                "allocator (", other->name(), "); create torch.cuda.MemPool() without one, "
                "or install gpu-arena with route='pluggable' for pluggable mem pools");
    check_rc(g_api.graph_pool_retain(dev, id.first, id.second), "gpu_arena_graph_pool_retain");
  }
  int getPoolUseCount(DeviceIndex dev, MempoolId_t id) override {
    int n = g_api.graph_pool_use_count(dev, id.first, id.second);
    check_rc(n, "gpu_arena_graph_pool_use_count");
    return n;
  }
#if GA_TORCH_AT_LEAST(2, 11)
  void setUseOnOOM(DeviceIndex, MempoolId_t, bool use_on_oom) override {
    if (use_on_oom) warn_use_on_oom();
  }
#else
  void setUseOnOOM(DeviceIndex, MempoolId_t) override { warn_use_on_oom(); }
#endif
#if GA_TORCH_AT_LEAST(2, 10)
  // A block of gpu-arena never spans arenas and is placed, not split off a segment torch
  // sees: there is nothing to turn off.
  void setNoSplit(DeviceIndex, MempoolId_t) override {}
#endif
  bool checkPoolLiveAllocations(DeviceIndex dev, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<PoolBlock> blocks = pool_blocks(dev, id);
    if (blocks.size() != expected.size()) return false;
    for (const PoolBlock& b : blocks) {
      if (expected.count(reinterpret_cast<void*>(b.ptr)) == 0) return false;
    }
    return true;
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex dev,
                                                          MempoolId_t id) override {
    auto state = std::make_shared<Checkpoint>();
    state->device = dev;
    state->id = id;
    state->blocks = pool_blocks(dev, id);
    return state;
  }
  // As CUDACachingAllocator does (and torch's _cuda_setCheckpointPoolState and cudagraph
  // trees rely on): every block live in the pool before is in ptrs_freed, every checkpointed
  // block gets a fresh DataPtr in dataptrs_allocd (a pointer may be in both: torch hands
  // those DataPtrs to the live storages it passes, whose old DataPtrs own nothing). In
  // gpu-arena a block live in both keeps its memory: only the others are freed or placed.
  cca::CheckpointDelta setCheckpointPoolState(
      DeviceIndex dev, std::shared_ptr<cca::AllocatorState> pps) override {
    auto st = std::dynamic_pointer_cast<Checkpoint>(pps);
    TORCH_CHECK(st != nullptr, "gpu-arena: setCheckpointPoolState needs a state from "
                "getCheckpointState of gpu-arena's allocator");
    TORCH_CHECK(st->device == dev, "gpu-arena: checkpoint of device ", int(st->device),
                " restored on device ", int(dev));
    std::vector<PoolBlock> before = pool_blocks(dev, st->id);
    check_rc(g_api.graph_pool_restore(dev, st->id.first, st->id.second, st->blocks.data(),
                                      st->blocks.size()),
             "gpu_arena_graph_pool_restore");
    std::unordered_set<uint64_t> kept;
    for (const PoolBlock& b : st->blocks) kept.insert(b.ptr);
    if (history_.active()) history_.restore_event(dev, st->id, before, st->blocks, kept);
    cca::CheckpointDelta delta;
    for (const PoolBlock& b : before) {
      void* p = reinterpret_cast<void*>(b.ptr);
      delta.ptrs_freed.push_back(p);
      if (kept.count(b.ptr) == 0) drop_share(p);
    }
    for (const PoolBlock& b : st->blocks) {
      void* p = reinterpret_cast<void*>(b.ptr);
      delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, dev));
    }
    return delta;
  }

  // ---- stats ----
  // DeviceStats from gpu_arena_stats, aggregate entries only ([0]; the small/large pool
  // entries stay 0: gpu-arena has no such split). Honoured: allocated_bytes, reserved_bytes
  // (current, peak), active_bytes (= allocated), requested_bytes (current, peak),
  // allocation and active (current; allocated/freed = allocations served/freed ever),
  // segment (current = arenas held; allocated/freed = arenas created/released ever),
  // num_ooms, num_device_alloc, num_device_free. The peaks of counts are not tracked by
  // gpu-arena: reported as the current value. Cumulative bytes (allocated/freed of the byte
  // stats), inactive_split*, oversize*, num_alloc_retries, num_sync_all_streams and
  // max_split_size are 0.
  cca::DeviceStats getDeviceStats(DeviceIndex dev) override {
    const Stats s = stats(dev);
    cca::DeviceStats d;
    auto set = [](auto& stat, uint64_t current, uint64_t peak, uint64_t allocated = 0,
                  uint64_t freed = 0) {
      stat[0].current = static_cast<int64_t>(current);
      stat[0].peak = static_cast<int64_t>(peak);
      stat[0].allocated = static_cast<int64_t>(allocated);
      stat[0].freed = static_cast<int64_t>(freed);
    };
    set(d.allocated_bytes, s.allocated_bytes, s.peak_allocated_bytes);
    set(d.active_bytes, s.allocated_bytes, s.peak_allocated_bytes);
    set(d.reserved_bytes, s.reserved_bytes, s.peak_reserved_bytes);
    set(d.requested_bytes, s.requested_bytes, s.peak_requested_bytes);
    set(d.allocation, s.allocations, s.allocations, s.alloc_count, s.free_count);
    set(d.active, s.allocations, s.allocations, s.alloc_count, s.free_count);
    set(d.segment, s.arenas, s.arenas, s.backend_creates, s.backend_destroys);
    d.num_ooms = static_cast<int64_t>(s.oom_count);
    d.num_device_alloc = static_cast<int64_t>(s.backend_creates);
    d.num_device_free = static_cast<int64_t>(s.backend_destroys);
    return d;
  }
  void resetAccumulatedStats(DeviceIndex dev) override {
    check_rc(g_api.reset_accumulated_stats(dev), "gpu_arena_reset_accumulated_stats");
  }
  void resetPeakStats(DeviceIndex dev) override {
    check_rc(g_api.reset_peak_stats(dev), "gpu_arena_reset_peak_stats");
  }
#if GA_TORCH_AT_LEAST(2, 10)
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex dev) override { return mem_info(dev); }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};
  }
#endif
  // Enforced by gpu-arena: a growth past fraction x the device's memory fails as out of
  // memory (gpu_arena_set_memory_fraction; 1 lifts the cap, gpu-arena's max_reserved too).
  double getMemoryFraction(DeviceIndex dev) override {
    check_device(dev);
    return fraction_[dev].load();
  }
  void setMemoryFraction(double fraction, DeviceIndex dev) override {
    check_device(dev);
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction);
    check_rc(g_api.set_memory_fraction(dev, fraction), "set_memory_fraction");
    fraction_[dev].store(fraction);
  }
  // The largest cached block is unknown: as CUDACachingAllocator's first guess when the
  // caller passes 0, the device's free memory.
  void cacheInfo(DeviceIndex dev, size_t* largest) override {
    if (*largest == 0) *largest = mem_info(dev).first;
  }
  void emptyCache(MempoolId_t id) override {
    Pending pending;  // segment_free entries take its context (RecordContext::ALL)
    if (history_.active()) pending.ctx = history_.gather(cca::RecordContext::ALL);
    PendingScope scope(&pending);
    if (id.first == 0 && id.second == 0) {
      // Blocks torch's CUDA IPC limbo keeps for consumers that are done with them (sent with
      // torch's own reductions) are freed first, so that empty_cache gives them back too.
      run_free_memory_callbacks();
      check_rc(g_api.empty_cache(-1), "gpu_arena_empty_cache");
      return;
    }
    // MemPool's destructor calls this for its pool without a device: every device (those
    // where the pool is unknown refuse, which is no error here).
    const int n = g_api.device_count();
    for (int dev = 0; dev < n; ++dev) g_api.graph_pool_empty_cache(dev, id.first, id.second);
  }
  // Segments (gpu-arena's arenas) and their blocks, from gpu_arena_segments, with the
  // contexts and traces of torch's memory history (history.h).
#if GA_TORCH_AT_LEAST(2, 11)
  cca::SnapshotInfo snapshot(MempoolId_t id, bool include_traces) override {
    return snapshot_of(id, include_traces);
  }
#else
  cca::SnapshotInfo snapshot(MempoolId_t id) override { return snapshot_of(id, true); }
#endif

  // ---- history and observers ----
  // torch's memory history (history.h); gpu-arena's own history is switched with it
  // (gpu_arena.torch.memory_snapshot() shows it).
#if GA_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear,
                     const std::vector<std::string>& skip_actions) override {
    history_.set(enabled, recorder, max_entries, when, clear, skip_actions);
    g_api.record_history(enabled ? 1 : 0, max_entries);
  }
#else
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear) override {
    history_.set(enabled, recorder, max_entries, when, clear, {});
    g_api.record_history(enabled ? 1 : 0, max_entries);
  }
#endif
  bool isHistoryEnabled() override { return history_.enabled(); }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (history_.enabled()) history_.annotate(c10::cuda::current_device(), md);
  }
  void pushCompileContext(std::string& md) override { history_.push_compile_context(md); }
  void popCompileContext() override { history_.pop_compile_context(); }
#if GA_TORCH_AT_LEAST(2, 10)
  void setUserMetadata(const std::string& md) override { history_.set_user_metadata(md); }
  std::string getUserMetadata() override { return history_.user_metadata(); }
#endif
#if GA_TORCH_AT_LEAST(2, 14)
  bool supportsUserMetadata() override { return true; }
#endif
#if GA_TORCH_AT_LEAST(2, 12)
  // Known while history (or a tracker) is on, for blocks allocated since.
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    return history_.active() ? history_.context_of(ptr) : nullptr;
  }
#endif
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mu_);
    oom_observers_.push_back(std::move(observer));
  }
  // Every trace entry from now on, history on or not (history.h).
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    history_.add_tracker(std::move(tracker));
  }
#if GA_TORCH_AT_LEAST(2, 12)
  // gpu-arena rejects nothing preemptively: kept, never called.
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mu_);
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif

  // ---- streams, copies, peers ----
  using cca::CUDAAllocator::recordStream;
  void recordStream(const DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // As CUDACachingAllocator: nothing for an empty storage, nor for memory this allocator
    // does not own (an imported CUDA IPC tensor, or a storage torch wrapped after sharing).
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) return;
    check_rc(g_api.record_stream_checked(ptr.get(), stream.stream()),
             "gpu_arena_record_stream");
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  // gpu-arena's memory is cuMemMap'ed (as expandable segments are): across devices without
  // P2P only cudaMemcpyPeerAsync handles it.
  cudaError_t memcpyAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_dev == src_dev) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, count, stream);
  }
  // gpu-arena maps its arenas for every device that can access them (cuMemSetAccess);
  // this enables legacy peer access for memory of other allocators, as torch's does.
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // The gpu-arena allocation containing ptr, and its requested size (CUDACachingAllocator
  // gives its whole segment; gpu-arena's arenas are not torch segments).
  void* getBaseAllocation(void* ptr, size_t* size) override {
    int dev = 0;
    void* base = find_allocation(ptr, size, &dev);
    return base;
  }

  // ---- torch.multiprocessing (CUDA IPC) ----
  // The allocation's share (ipc_shares.h), made on its first send; unshared at its free.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    size_t len = 0;
    int dev = 0;
    void* base = find_allocation(ptr, &len, &dev);
    const Share s = share_of(base, len);
    std::string handle(kHandleMagic, kHandleMagicLen);
    handle.append(reinterpret_cast<const char*>(s.bytes), kShareBytes);
    return cca::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base), handle};
  }
  Share share_of(void* base, size_t len) {
    return shares_.get_or_make(base, len, g_api.share, last_error);
  }
  // gpu_arena_torch_share_blocks: the share of the allocation holding `ptr`, and `ptr`'s
  // offset in it.
  Share share_block(const void* ptr, uint64_t* offset) {
    size_t len = 0;
    int dev = 0;
    void* base = find_allocation(const_cast<void*>(ptr), &len, &dev);
    *offset = static_cast<uint64_t>(static_cast<const char*>(ptr) - static_cast<char*>(base));
    return share_of(base, len);
  }
  // One import per handle in this process, shared by every storage torch rebuilds from it;
  // closed when the last one dies.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    TORCH_CHECK(handle.size() == kHandleMagicLen + kShareBytes &&
                    handle.compare(0, kHandleMagicLen, kHandleMagic) == 0,
                "gpu-arena: a CUDA IPC handle not made by gpu-arena's torch allocator (",
                handle.size(), " bytes): install gpu-arena's native allocator in the "
                "producer too, or in neither process");
    return imports_.get_or_import(
        handle, kHandleMagicLen,
        [](const Share& s) {
          void* p = nullptr;
          check_rc(g_api.import(&s, &p), "gpu_arena_import");
          return p;
        },
        [](void* q) {
          if (g_api.close(q) < 0) TORCH_WARN("gpu-arena: closing import ", q, ": ", last_error());
        });
  }

  // ---- lifecycle ----
  void init(int device_count) override {
    g_api.init(device_count);
    initialized_.store(true);
  }
  bool initialized() override { return initialized_.load(); }
  // Kept for isEnabled(); gpu-arena always serves (torch's "uncached" mode is not mirrored).
  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }
  std::string name() override { return "gpu_arena"; }
  void bind_history(const std::string& lib_path) {
    history_.bind(lib_path, g_api.allocation_of);
  }

 private:
  struct Route {
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };

  void* alloc(size_t n, DeviceIndex dev, cudaStream_t stream) {
    if (C10_UNLIKELY(history_.active())) return alloc_traced(n, dev, stream);
    void* p = malloc_routed(n, dev, stream);
    if (C10_UNLIKELY(p == nullptr)) return alloc_failed(n, dev, stream);
    return p;
  }
  // alloc while history or a tracker is on: the context (gathered first, outside any lock),
  // segment entries from the arena observer on this thread (t_pending), then the alloc
  // entry; an OOM entry instead when it fails.
  C10_NOINLINE void* alloc_traced(size_t n, DeviceIndex dev, cudaStream_t stream) {
    Pending pending;
    pending.stream = stream;
    pending.ctx = history_.gather(cca::RecordContext::STATE);
    PendingScope scope(&pending);
    void* p = malloc_routed(n, dev, stream, &pending.pool);
    if (p == nullptr) p = alloc_failed(n, dev, stream, &pending);
    history_.alloc_event(p, n, dev, pending);
    return p;
  }
  // `pool`: where the id of the graph pool it was routed to goes (set before allocating).
  void* malloc_routed(size_t n, DeviceIndex dev, cudaStream_t stream,
                      MempoolId_t* pool = nullptr) {
    if (C10_LIKELY(dev >= kMaxDevices || open_[dev].load(std::memory_order_acquire) == 0)) {
      return g_api.malloc(static_cast<ssize_t>(n), dev, stream);
    }
    bool routed = false;
    MempoolId_t id{0, 0};
    {
      // As CUDACachingAllocator: the most recent route whose filter takes the stream.
      std::lock_guard<std::mutex> g(routes_mu_);
      const auto& v = routes_[dev];
      for (auto it = v.rbegin(); it != v.rend() && !routed; ++it) {
        if (it->filter(stream)) {
          routed = true;
          id = it->id;
        }
      }
    }
    if (!routed) return g_api.malloc(static_cast<ssize_t>(n), dev, stream);
    if (pool != nullptr) *pool = id;
    return g_api.graph_pool_malloc(dev, id.first, id.second, n, stream);
  }
  // `traced`: alloc_traced's (then an OOM entry is recorded).
  C10_NOINLINE void* alloc_failed(size_t n, DeviceIndex dev, cudaStream_t stream,
                                  Pending* traced = nullptr) {
    // The code and message first: the callbacks may call gpu-arena (its last error changes).
    int code = g_api.last_error_code();
    std::string cause = take_string(g_api.alloc_error_message(static_cast<ssize_t>(n), dev));
    if (code == kErrOutOfMemory && run_free_memory_callbacks()) {
      if (void* p = malloc_routed(n, dev, stream, traced ? &traced->pool : nullptr)) return p;
      code = g_api.last_error_code();
      cause = take_string(g_api.alloc_error_message(static_cast<ssize_t>(n), dev));
    }
    TORCH_CHECK(code == kErrOutOfMemory, cause);
    const std::string prefix = "CUDA out of memory. ";
    if (cause.compare(0, prefix.size(), prefix) == 0) cause.erase(0, prefix.size());
    size_t free_bytes = 0, total = 0;
    try {
      std::tie(free_bytes, total) = mem_info(dev);
    } catch (const std::exception&) {
    }
    if (traced != nullptr) history_.oom_event(dev, free_bytes, n, *traced);
    StatsBuffer buf{};
    const bool have_stats = g_api.stats(dev, &buf) == 0;
    const Stats& s = buf.s;
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(observers_mu_);
      observers = oom_observers_;
    }
    // As CUDACachingAllocator: the size asked for, the memory allowed (the fraction's share
    // of the device), the device's free bytes. No lock held: they may take a snapshot.
    const double fraction = dev < kMaxDevices ? fraction_[dev].load() : 1.0;
    const size_t allowed = fraction < 1.0 ? static_cast<size_t>(fraction * total) : total;
    for (const auto& obs : observers) obs(dev, n, allowed, free_bytes);
    std::string held;
    if (have_stats) {
      held = "Of the allocated memory " + format_size(s.allocated_bytes) +
             " is allocated by gpu-arena, and " +
             format_size(s.reserved_bytes - std::min(s.reserved_bytes, s.allocated_bytes)) +
             " is reserved by gpu-arena but unallocated. ";
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                     format_size(n), ". GPU ", int(dev), " has a total capacity of ",
                     format_size(total), " of which ", format_size(free_bytes), " is free. ",
                     held, "gpu-arena: ", cause);
    return nullptr;  // not reached
  }
  // As CUDACachingAllocator before it gives up: torch's registered callbacks (the CUDA IPC
  // limbo collector); true when one freed something (then the allocation is retried once).
  static bool run_free_memory_callbacks() {
    bool freed = false;
    for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
      freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
    }
    return freed;
  }

  Stats stats(DeviceIndex dev) {
    StatsBuffer buf{};
    check_rc(g_api.stats(dev, &buf), "gpu_arena_stats");
    return buf.s;
  }
  static std::vector<PoolBlock> pool_blocks(DeviceIndex dev, MempoolId_t id) {
    std::vector<PoolBlock> out;
    for (;;) {
      ssize_t n = g_api.graph_pool_blocks(dev, id.first, id.second, out.data(), out.size());
      check_rc(n, "gpu_arena_graph_pool_blocks");
      if (static_cast<size_t>(n) <= out.size()) {
        out.resize(static_cast<size_t>(n));
        return out;
      }
      out.resize(static_cast<size_t>(n));
    }
  }
  static void* find_allocation(void* ptr, size_t* size, int* dev) {
    void* base = nullptr;
    size_t requested = 0;
    check_rc(g_api.allocation_of(ptr, &base, &requested, dev), "gpu_arena_allocation_of");
    if (size != nullptr) *size = requested;
    return base;
  }
  void drop_share(void* ptr) {
    Share s{};
    if (C10_LIKELY(!shares_.take(ptr, &s))) return;
    if (g_api.unshare(&s) < 0) TORCH_WARN("gpu-arena: unshare of ", ptr, ": ", last_error());
  }
  // As CUDACachingAllocator's: every segment, or only those of pool `id` when it is not
  // {0, 0}; sorted by address. An arena is one segment (is_large: not a small-block arena).
  // With history on: each block's and segment's context, the traces (include_traces).
  cca::SnapshotInfo snapshot_of(MempoolId_t id, bool include_traces) {
    cca::SnapshotInfo info{};
    const int n = std::max(g_api.device_count(), 0);
    const bool all = id.first == 0 && id.second == 0;
    std::vector<size_t> active_bytes(static_cast<size_t>(n), 0);
    auto lock = history_.lock();  // no allocation is traced while this is built
    for (int dev = 0; dev < n; ++dev) {
      std::vector<Segment> segs;
      std::vector<SegmentBlock> blocks;
      size_t n_blocks = 0;
      for (;;) {
        ssize_t k = g_api.segments(dev, segs.data(), segs.size(), blocks.data(), blocks.size(),
                                   &n_blocks);
        check_rc(k, "gpu_arena_segments");
        const bool fits = static_cast<size_t>(k) <= segs.size() && n_blocks <= blocks.size();
        segs.resize(static_cast<size_t>(k));
        blocks.resize(n_blocks);
        if (fits) break;
      }
      for (const Segment& s : segs) {
        const MempoolId_t owner = s.in_graph_pool ? MempoolId_t{s.pool_id0, s.pool_id1}
                                                  : MempoolId_t{0, 0};
        if (!all && owner != id) continue;
        cca::SegmentInfo si;
        si.device = static_cast<DeviceIndex>(dev);
        si.address = s.address;
        si.total_size = s.bytes;
        si.is_large = s.small == 0;
        si.owner_private_pool_id = owner;
        si.context_when_allocated = history_.segment_context(s.address);
        for (uint64_t i = s.first_block; i < s.first_block + s.block_count; ++i) {
          if (i >= blocks.size()) break;
          const SegmentBlock& b = blocks[i];
          cca::BlockInfo bi;
          bi.size = b.bytes;
          bi.requested_size = b.requested;
          // A range gpu-arena holds after its free (its per-thread cache, or waiting for
          // shares or streams) has requested 0: inactive, as a cached block of torch's.
          bi.allocated = bi.active = b.allocated != 0 && b.requested != 0;
          if (bi.allocated) {
            si.allocated_size += b.bytes;
            si.active_size += b.bytes;
            si.requested_size += b.requested;
            bi.context_when_allocated = history_.block_context(b.address);
          }
          si.blocks.push_back(std::move(bi));
        }
        active_bytes[static_cast<size_t>(dev)] += si.active_size;
        info.segments.push_back(std::move(si));
      }
    }
    std::sort(info.segments.begin(), info.segments.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    history_.fill(info, n, include_traces, active_bytes);
    return info;
  }
  static void warn_use_on_oom() {
    TORCH_WARN_ONCE("gpu-arena: MemPool use_on_oom has no effect (gpu-arena's general pool "
                    "never borrows a private pool's memory)");
  }

  std::array<std::atomic<int>, kMaxDevices> open_{};  // routes open per device
  std::mutex routes_mu_;
  std::array<std::vector<Route>, kMaxDevices> routes_;
  std::array<std::atomic<double>, kMaxDevices> fraction_;
  BlockShares shares_;   // this process's allocations sent to others
  ImportCache imports_;  // other processes' allocations torch rebuilt here
  std::mutex observers_mu_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if GA_TORCH_AT_LEAST(2, 12)
  std::vector<cca::OomRejectionObserver> oom_rejection_observers_;
#endif
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  History history_;  // torch's memory history (history.h)
};

void raw_delete_fn(void* ptr) { g_self->release(ptr, /*throw_on_error=*/false); }

}  // namespace
}  // namespace gpu_arena_native

#include "c_entry.h"
