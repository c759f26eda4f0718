// The native torch allocator (python/gpu_arena/native/allocator.cpp) without a GPU and
// without libtorch_cuda: compiled into this program with a torch wheel's headers, linked to
// its libc10 and libc10_cuda, run over gpu-arena's sim backend. The CUDA runtime calls c10
// makes are defined here (this executable's definitions come first in symbol lookup, so they
// stand in for libcudart's), and so is torch's changeCurrentAllocator (libtorch_cuda's; what
// it does: refuse when the current allocator is initialized, keep and store the new one).
// Built and run by scripts/check-torch-native.sh. Usage: harness LIBGPU_ARENA [CONF]
#include <torch/version.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "harness.h"

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#define GA_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// One device, 80 GiB of which 3 GiB free.
static int g_dev = 0;
extern "C" {
cudaError_t cudaGetDevice(int* d) {
  *d = g_dev;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  g_dev = d;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = 3ull << 30;
  *total = 80ull << 30;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* lo, int* hi) {
  *lo = 0;
  *hi = -1;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
}  // extern "C"

namespace torch::cuda::CUDAPluggableAllocator {
void changeCurrentAllocator(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>& a) {
  TORCH_CHECK(!c10::cuda::CUDACachingAllocator::allocator.load()->initialized(),
              "Can't swap an already initialized allocator");
  static std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> keep;
  keep = a;
  c10::cuda::CUDACachingAllocator::allocator.store(a.get());
}
}  // namespace torch::cuda::CUDAPluggableAllocator
// libtorch_cuda registers the real one (c10's default throws).
namespace c10::cuda::_internal {
void setHasPrimaryContext(bool (*func)(c10::DeviceIndex));
}

extern "C" int gpu_arena_torch_install_native(const char*, char*, size_t);

// A free-memory callback (torch's CUDA IPC collector is one): frees the hostage.
static c10::DataPtr* g_hostage = nullptr;
static int g_callback_runs = 0;
struct FreeHostage : c10::FreeMemoryCallback {
  bool Execute() override {
    ++g_callback_runs;
    if (g_hostage == nullptr || g_hostage->get() == nullptr) return false;
    g_hostage->clear();
    return true;
  }
};
namespace c10 {
REGISTER_FREE_MEMORY_CALLBACK(free_hostage, ::FreeHostage);
}
// gpu_arena_stats_t as words: v[9] shares_live, v[10] imports_live, v[16] deferred_free_bytes.
struct StatsBuf {
  uint64_t v[300];
};

namespace cca = c10::cuda::CUDACachingAllocator;
int failures = 0, passes = 0;

// torch's memory history: a context recorder making contexts of our own type, numbered.
struct TestCtx : c10::GatheredContext {
  explicit TestCtx(int i) : id(i) {}
  int id;
};
static int g_ctx_made = 0;
static std::shared_ptr<c10::GatheredContext> make_ctx() {
  return std::make_shared<TestCtx>(++g_ctx_made);
}
static int ctx_id(const std::shared_ptr<c10::GatheredContext>& c) {
  auto* t = dynamic_cast<TestCtx*>(c.get());
  return t != nullptr ? t->id : 0;
}
static void record_history(cca::CUDAAllocator* a, bool on, size_t max, cca::RecordContext when,
                           bool clear, const std::vector<std::string>& skip = {}) {
#if GA_TORCH_AT_LEAST(2, 11)
  a->recordHistory(on, on ? &make_ctx : nullptr, max, when, clear, skip);
#else
  (void)skip;
  a->recordHistory(on, on ? &make_ctx : nullptr, max, when, clear);
#endif
}
static cca::SnapshotInfo take_snapshot(cca::CUDAAllocator* a, bool traces = true) {
#if GA_TORCH_AT_LEAST(2, 11)
  return a->snapshot({0, 0}, traces);
#else
  (void)traces;
  return a->snapshot({0, 0});
#endif
}
using Act = cca::TraceEntry::Action;
static std::vector<Act> actions(const std::vector<cca::TraceEntry>& t, bool segments = true) {
  std::vector<Act> out;
  for (const auto& te : t) {
    const bool seg = te.action_ == Act::SEGMENT_ALLOC || te.action_ == Act::SEGMENT_FREE;
    if (segments || !seg) out.push_back(te.action_);
  }
  return out;
}
static void print_trace(const char* what, const std::vector<cca::TraceEntry>& t) {
  std::printf("%s: %zu entries\n", what, t.size());
  for (const auto& te : t) {
    std::printf("  action=%d addr=0x%zx size=%zu ctx=%d pool=%lu,%lu t_us=%lld\n",
                int(te.action_), te.addr_, te.size_, ctx_id(te.context_),
                (unsigned long)te.mempool_.first, (unsigned long)te.mempool_.second,
                (long long)te.time_.t_);
  }
}
static std::vector<Act> g_tracked;  // what an attached trace tracker saw

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  c10::cuda::_internal::setHasPrimaryContext([](c10::DeviceIndex) { return true; });
  const char* lib = argv[1];
  const char* conf = argc > 2 ? argv[2] : "backend=sim,max_reserved=256MiB,arena_size=64MiB";
  void* h = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
  if (std::getenv("GA_HARNESS_CONSUMER") != nullptr) return ipc_consumer_main(lib, conf, h);
  auto configure = reinterpret_cast<int (*)(const char*)>(dlsym(h, "gpu_arena_configure"));
  EXPECT(configure(conf) == 0);
  char err[1024] = {0};
  int rc = gpu_arena_torch_install_native(lib, err, sizeof err);
  std::printf("install: %d %s\n", rc, err);
  EXPECT(rc == 0);
  EXPECT(gpu_arena_torch_install_native(lib, err, sizeof err) == 0);  // idempotent
  auto* a = cca::get();
  EXPECT(a->name() == "gpu_arena");
  a->init(1);
  EXPECT(a->initialized());

  // plain allocations
  {
    c10::DataPtr p = a->allocate(1000);
    EXPECT(p.get() != nullptr && p.get() == p.get_context());
    EXPECT(p.get_deleter() == a->raw_deleter());
    EXPECT(p.device() == c10::Device(c10::DeviceType::CUDA, 0));
    auto st = a->getDeviceStats(0);
    EXPECT(st.allocation[0].current == 1 && st.allocated_bytes[0].current >= 1000);
    EXPECT(st.requested_bytes[0].current == 1000);
    size_t sz = 0;
    void* base = a->getBaseAllocation(static_cast<char*>(p.get()), &sz);
    EXPECT(base == p.get() && sz == 1000);
    c10::DataPtr z = a->allocate(0);
    EXPECT(z.get() == nullptr);
    a->recordStream(p, c10::cuda::getCurrentCUDAStream(0));
  }
  EXPECT(a->getDeviceStats(0).allocation[0].current == 0);
  void* r = a->raw_alloc(4096);
  EXPECT(r != nullptr);
  a->raw_delete(r);
  bool threw = false;
  try {
    a->raw_delete(r);
  } catch (const c10::Error& e) {
    threw = true;
    std::printf("double free: %s\n", e.what_without_backtrace());
  }
  EXPECT(threw);

  // graph pool routing, checkpoints
  c10::MempoolId_t pool{0, 7};
  a->beginAllocateToPool(0, pool, [](cudaStream_t) { return true; });
  threw = false;
  try {
    a->beginAllocateToPool(0, pool, [](cudaStream_t) { return true; });
  } catch (const c10::Error&) {
    threw = true;
  }
  EXPECT(threw);
  c10::DataPtr p1 = a->allocate(1 << 20);
  c10::DataPtr p2 = a->allocate(3000);
  a->endAllocateToPool(0, pool);
  c10::DataPtr outside = a->allocate(3000);
  EXPECT(a->getPoolUseCount(0, pool) == 1);
  EXPECT(a->checkPoolLiveAllocations(0, pool, {p1.get(), p2.get()}));
  EXPECT(!a->checkPoolLiveAllocations(0, pool, {p1.get(), outside.get()}));
  auto state = a->getCheckpointState(0, pool);
  void* p1_addr = p1.get();
  void* p2_addr = p2.get();
  p1.clear();  // freed back into the pool
  EXPECT(a->checkPoolLiveAllocations(0, pool, {p2_addr}));
  auto snap = a->snapshot({0, 0}, true);
  std::printf("snapshot: %zu segments, %zu traces\n", snap.segments.size(),
              snap.device_traces.size());
  EXPECT(snap.segments.size() >= 2);
  auto psnap = a->snapshot(pool, true);
  bool all_pool = !psnap.segments.empty();
  for (auto& s : psnap.segments) all_pool &= s.owner_private_pool_id == pool;
  EXPECT(all_pool);
  auto delta = a->setCheckpointPoolState(0, state);
  std::printf("delta: %zu freed, %zu allocd\n", delta.ptrs_freed.size(),
              delta.dataptrs_allocd.size());
  EXPECT(delta.ptrs_freed.size() == 1 && delta.ptrs_freed[0] == p2_addr);
  EXPECT(delta.dataptrs_allocd.size() == 2);
  EXPECT(a->checkPoolLiveAllocations(0, pool, {p1_addr, p2_addr}));
  // as torch does with DataPtrs not handed to storages: release, raw_delete later
  for (auto& d : delta.dataptrs_allocd) {
    EXPECT(d.get_deleter() == a->raw_deleter());
    if (d.get() == p1_addr) d.release_context();
  }
  delta.dataptrs_allocd.clear();  // frees p2 (its fresh DataPtr owns it)
  p2.release_context();           // the old DataPtr owns nothing any more
  EXPECT(a->checkPoolLiveAllocations(0, pool, {p1_addr}));
  a->raw_delete(p1_addr);
  EXPECT(a->checkPoolLiveAllocations(0, pool, {}));
  a->releasePool(0, pool);
  EXPECT(a->getPoolUseCount(0, pool) == 0);
  a->emptyCache(pool);
  outside.clear();

  // MemPool-style: createOrIncrefPool, another allocator refused
  c10::MempoolId_t mp{0, 9};
  a->createOrIncrefPool(0, mp, nullptr);
  EXPECT(a->getPoolUseCount(0, mp) == 1);
  a->releasePool(0, mp);

  // stats, resets
  a->resetPeakStats(0);
  a->resetAccumulatedStats(0);
  auto st = a->getDeviceStats(0);
  std::printf("after resets: alloc.allocated=%ld peak alloc bytes=%ld reserved=%ld\n",
              long(st.allocation[0].allocated), long(st.allocated_bytes[0].peak),
              long(st.reserved_bytes[0].current));
  EXPECT(st.allocation[0].allocated == 0);
  a->emptyCache({0, 0});

  // OOM
  threw = false;
  try {
    a->allocate(1ull << 30);
  } catch (const c10::OutOfMemoryError& e) {
    threw = true;
    std::string m = e.what_without_backtrace();
    std::printf("OOM: %s\n", m.c_str());
    // PyTorch's own wording and sizes (its format_size: 1 GiB is "1024.00 MiB").
    EXPECT(m.rfind("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total "
                   "capacity of 80.00 GiB of which 3.00 GiB is free.", 0) == 0);
  }
  EXPECT(threw);
  EXPECT(a->getDeviceStats(0).num_ooms >= 1);

  // IPC within the process
  {
    c10::DataPtr p = a->allocate(5000);
    auto h1 = a->shareIpcHandle(p.get());
    auto h2 = a->shareIpcHandle(static_cast<char*>(p.get()) + 0);
    EXPECT(h1.handle == h2.handle && h1.offset == 0);
    EXPECT(h1.handle.size() == 12 + 128);
    std::shared_ptr<void> imp = a->getIpcDevPtr(h1.handle);
    std::shared_ptr<void> imp2 = a->getIpcDevPtr(h1.handle);
    EXPECT(imp != nullptr && imp.get() == imp2.get());
    threw = false;
    try {
      a->getIpcDevPtr(std::string("\x02" "cxxxx"));  // torch's own handle shape
    } catch (const c10::Error& e) {
      threw = true;
      std::printf("bad handle: %s\n", e.what_without_backtrace());
    }
    EXPECT(threw);
    imp.reset(); imp2.reset();
  }
  auto ga_stats = reinterpret_cast<int (*)(int, StatsBuf*)>(dlsym(h, "gpu_arena_stats"));
  {
    StatsBuf sb{};
    ga_stats(0, &sb);
    std::printf("after IPC: shares_live=%lu imports_live=%lu deferred=%lu\n",
                (unsigned long)sb.v[9], (unsigned long)sb.v[10], (unsigned long)sb.v[16]);
    EXPECT(sb.v[9] == 0 && sb.v[10] == 0 && sb.v[16] == 0);
  }
  // a view: same handle, its offset
  {
    c10::DataPtr p = a->allocate(8192);
    auto h1 = a->shareIpcHandle(p.get());
    auto h2 = a->shareIpcHandle(static_cast<char*>(p.get()) + 512);
    EXPECT(h1.handle == h2.handle && h2.offset == 512);
    size_t sz = 0;
    EXPECT(a->getBaseAllocation(static_cast<char*>(p.get()) + 100, &sz) == p.get() && sz == 8192);
  }
  // routing: a filter that refuses, nested routes (the most recent wins), by stream
  {
    c10::MempoolId_t A{0, 21}, B{0, 22};
    cudaStream_t s1 = reinterpret_cast<cudaStream_t>(0x1111);
    a->beginAllocateToPool(0, A, [](cudaStream_t) { return true; });
    a->beginAllocateToPool(0, B, [s1](cudaStream_t s) { return s == s1; });
    void* x = a->raw_alloc_with_stream(1000, s1);  // B
    void* y = a->raw_alloc(1000);                    // default stream: A
    a->endAllocateToPool(0, B);
    void* z = a->raw_alloc_with_stream(1000, s1);  // A
    a->endAllocateToPool(0, A);
    void* w = a->raw_alloc(1000);  // general
    EXPECT(a->checkPoolLiveAllocations(0, B, {x}));
    EXPECT(a->checkPoolLiveAllocations(0, A, {y, z}));
    for (void* q : {x, y, z, w}) a->raw_delete(q);
    threw = false;
    try { a->endAllocateToPool(0, A); } catch (const c10::Error&) { threw = true; }
    EXPECT(threw);
    a->releasePool(0, A);
    a->releasePool(0, B);
    a->emptyCache(A);
  }
  // OOM: torch's free-memory callbacks run, then one retry
  {
    const int runs_before = g_callback_runs;
    c10::DataPtr hostage = a->allocate(200ull << 20);
    g_hostage = &hostage;
    c10::DataPtr b = a->allocate(100ull << 20);
    std::printf("callback: b=%p runs=%d hostage=%p\n", b.get(), g_callback_runs, hostage.get());
    EXPECT(b.get() != nullptr && g_callback_runs == runs_before + 1 && hostage.get() == nullptr);
    g_hostage = nullptr;
  }
  // The memory fraction is enforced by gpu-arena: a growth past it is an OOM; 1 lifts it
  // (and the configuration's max_reserved with it).
  {
    a->emptyCache({0, 0});
    a->setMemoryFraction(0.0, 0);
    EXPECT(a->getMemoryFraction(0) == 0.0);
    bool oom = false;
    try {
      c10::DataPtr p = a->allocate(64ull << 20);
    } catch (const c10::OutOfMemoryError& e) {
      oom = std::string(e.what()).find("max_reserved") != std::string::npos;
    }
    EXPECT(oom);
    bool bad = false;
    try { a->setMemoryFraction(1.5, 0); } catch (const c10::Error&) { bad = true; }
    EXPECT(bad && a->getMemoryFraction(0) == 0.0);
    a->setMemoryFraction(1.0, 0);
    c10::DataPtr big = a->allocate(512ull << 20);  // past the configured 256 MiB cap
    EXPECT(big.get() != nullptr);
  }

  // torch's memory history: recordHistory, traces and contexts in snapshot()
  {
    a->emptyCache({0, 0});  // no arena left: the first allocation below maps one
    EXPECT(!a->isHistoryEnabled());
    record_history(a, true, 1000, cca::RecordContext::ALL, true);
    EXPECT(a->isHistoryEnabled());
    c10::DataPtr p1 = a->allocate(1000);
    void* p1_addr = p1.get();
    void* p2 = a->raw_alloc(5000);
    p1.clear();
    auto s = take_snapshot(a);
    EXPECT(s.device_traces.size() == 1);
    const auto tr = s.device_traces.empty() ? std::vector<cca::TraceEntry>{} : s.device_traces[0];
    print_trace("history", tr);
    EXPECT(actions(tr) == (std::vector<Act>{Act::SEGMENT_ALLOC, Act::ALLOC, Act::ALLOC,
                                            Act::FREE_REQUESTED, Act::FREE_COMPLETED}));
    int p2_ctx = -1;
    size_t arena_bytes = 0;
    if (tr.size() == 5) {
      const auto at = [](void* p) { return reinterpret_cast<size_t>(p); };
      EXPECT(tr[1].addr_ == at(p1_addr) && tr[1].size_ == 1000);
      EXPECT(tr[2].addr_ == at(p2) && tr[2].size_ == 5000);
      EXPECT(tr[3].addr_ == at(p1_addr) && tr[3].size_ == 1000);
      EXPECT(tr[4].addr_ == at(p1_addr) && tr[4].size_ == 1000);
      // RecordContext::ALL: a context per alloc and free; the arena's is its allocation's
      EXPECT(ctx_id(tr[1].context_) > 0 && ctx_id(tr[0].context_) == ctx_id(tr[1].context_));
      EXPECT(ctx_id(tr[2].context_) > ctx_id(tr[1].context_));
      EXPECT(ctx_id(tr[3].context_) > ctx_id(tr[2].context_));
      p2_ctx = ctx_id(tr[2].context_);
      arena_bytes = tr[0].size_;
      bool seg = false;  // segment_alloc is the snapshot's segment (the arena)
      for (const auto& sg : s.segments) {
        seg |= sg.address == tr[0].addr_ && sg.total_size == tr[0].size_ &&
               ctx_id(sg.context_when_allocated) == ctx_id(tr[0].context_);
      }
      EXPECT(seg);
      // microseconds since the epoch, in order
      EXPECT(tr[0].time_.t_ > 1600000000LL * 1000000 && tr[0].time_.t_ <= tr[4].time_.t_);
    }
    // the live block: its requested size and its allocation's context
    auto live_ctx = [](const cca::SnapshotInfo& sn, int* n) {
      int ctx = 0;
      *n = 0;
      for (const auto& sg : sn.segments) {
        for (const auto& b : sg.blocks) {
          if (!b.allocated) continue;
          ++*n;
          if (b.requested_size == 5000) ctx = ctx_id(b.context_when_allocated);
        }
      }
      return ctx;
    };
    int n_live = 0;
    EXPECT(live_ctx(s, &n_live) == p2_ctx && n_live == 1);
#if GA_TORCH_AT_LEAST(2, 11)
    auto no_traces = a->snapshot({0, 0}, false);  // include_traces=false: none, contexts still
    EXPECT(no_traces.device_traces.empty());
    EXPECT(live_ctx(no_traces, &n_live) == p2_ctx && n_live == 1);
#endif
#if GA_TORCH_AT_LEAST(2, 12)
    EXPECT(ctx_id(a->getContextForPointer(p2)) == p2_ctx);
#endif
    // OOM (no growth allowed): an oom entry last (addr_: the device's free bytes), with the
    // allocation's context
    a->setMemoryFraction(0.0, 0);
    bool oom = false;
    try {
      a->allocate(1ull << 30);
    } catch (const c10::OutOfMemoryError&) {
      oom = true;
    }
    a->setMemoryFraction(1.0, 0);
    auto so = take_snapshot(a);
    EXPECT(oom && !so.device_traces[0].empty());
    if (!so.device_traces[0].empty()) {
      const auto& te = so.device_traces[0].back();
      EXPECT(te.action_ == Act::OOM && te.size_ == (1ull << 30) && te.addr_ == (3ull << 30) &&
             ctx_id(te.context_) > 0);
    }

    // RecordContext::STATE: contexts with live blocks only; clearHistory; skip_actions
    record_history(a, true, 1000, cca::RecordContext::STATE, true, {"free_requested"});
    {
      c10::DataPtr q = a->allocate(2000);
    }
    auto s2 = take_snapshot(a);
    print_trace("STATE, skip free_requested", s2.device_traces[0]);
#if GA_TORCH_AT_LEAST(2, 11)
    EXPECT(actions(s2.device_traces[0], false) ==
           (std::vector<Act>{Act::ALLOC, Act::FREE_COMPLETED}));
#else
    EXPECT(actions(s2.device_traces[0], false) ==
           (std::vector<Act>{Act::ALLOC, Act::FREE_REQUESTED, Act::FREE_COMPLETED}));
#endif
    bool no_ctx = true;
    for (const auto& te : s2.device_traces[0]) no_ctx &= te.context_ == nullptr;
    EXPECT(no_ctx && live_ctx(s2, &n_live) == p2_ctx);

    // compile context, user metadata, annotations
    std::string cc = "graph_0";
    a->pushCompileContext(cc);
#if GA_TORCH_AT_LEAST(2, 10)
    a->setUserMetadata("phase=fwd");
    EXPECT(a->getUserMetadata() == "phase=fwd");
#endif
    a->recordAnnotation({{"name", "fwd"}, {"stage", "START"}});
    void* m = a->raw_alloc(300);
    a->popCompileContext();
#if GA_TORCH_AT_LEAST(2, 10)
    a->setUserMetadata("");
#endif
    a->raw_delete(m);
    auto s3 = take_snapshot(a);
    bool tagged = false, untagged = false;
    for (const auto& te : s3.device_traces[0]) {
      if (te.addr_ != reinterpret_cast<size_t>(m)) continue;
      if (te.action_ == Act::ALLOC) {
        tagged = te.compile_context_ == "graph_0";
#if GA_TORCH_AT_LEAST(2, 10)
        tagged &= te.user_metadata_ == "phase=fwd";
#endif
      }
      if (te.action_ == Act::FREE_COMPLETED) untagged = te.compile_context_ == "N/A";
    }
    EXPECT(tagged && untagged);
    EXPECT(s3.external_annotations.size() == 1 &&
           s3.external_annotations[0].metadata_["name"] == "fwd" &&
           s3.external_annotations[0].time_.t_ > 1600000000LL * 1000000);

    // the ring keeps the newest max_entries; RecordContext::NEVER gathers nothing
    record_history(a, true, 4, cca::RecordContext::NEVER, true);
    const int made = g_ctx_made;
    for (int i = 0; i < 10; ++i) {
      c10::DataPtr d = a->allocate(100 + i);
    }
    auto s4 = take_snapshot(a);
    const auto& t4 = s4.device_traces[0];
    print_trace("ring of 4", t4);
    EXPECT(t4.size() == 4 && g_ctx_made == made);
    if (t4.size() == 4) {
      EXPECT(t4[0].action_ == Act::FREE_COMPLETED && t4[0].size_ == 108);
      EXPECT(t4[1].action_ == Act::ALLOC && t4[1].size_ == 109);
      EXPECT(t4[3].action_ == Act::FREE_COMPLETED && t4[3].size_ == 109);
    }
    // shrunk without clearing: the newest 2 (the snapshot entry of the last snapshot last)
    record_history(a, true, 2, cca::RecordContext::NEVER, false);
    auto s5 = take_snapshot(a);
    EXPECT(actions(s5.device_traces[0]) ==
           (std::vector<Act>{Act::FREE_COMPLETED, Act::SNAPSHOT}));

    // checkpoints: the pool's blocks, a free, the restore putting it back (an alloc entry)
    record_history(a, true, 1000, cca::RecordContext::ALL, true);
    c10::MempoolId_t hp{0, 31};
    a->beginAllocateToPool(0, hp, [](cudaStream_t) { return true; });
    c10::DataPtr x = a->allocate(4096);
    c10::DataPtr y = a->allocate(8192);
    a->endAllocateToPool(0, hp);
    auto state = a->getCheckpointState(0, hp);
    void* xa = x.get();
    x.clear();
    auto delta = a->setCheckpointPoolState(0, state);
    for (auto& d : delta.dataptrs_allocd) d.release_context();  // x, y: owned as before
    auto s6 = take_snapshot(a);
    print_trace("checkpoint", s6.device_traces[0]);
    int x_allocs = 0, y_allocs = 0;
    bool pool_seg = false, pool_ids = true;
    for (const auto& te : s6.device_traces[0]) {
      pool_seg |= te.action_ == Act::SEGMENT_ALLOC && te.mempool_ == hp;
      if (te.action_ != Act::ALLOC) continue;
      pool_ids &= te.mempool_ == hp;
      x_allocs += te.addr_ == reinterpret_cast<size_t>(xa);
      y_allocs += te.addr_ == reinterpret_cast<size_t>(y.get());
    }
    EXPECT(x_allocs == 2 && y_allocs == 1 && pool_seg && pool_ids);
    EXPECT(!s6.device_traces[0].empty() && s6.device_traces[0].back().action_ == Act::ALLOC &&
           s6.device_traces[0].back().addr_ == reinterpret_cast<size_t>(xa));
    a->raw_delete(xa);
    y.clear();
    a->releasePool(0, hp);
    a->emptyCache(hp);

    // segment_free: the arena released by empty_cache, with empty_cache's context
    record_history(a, true, 1000, cca::RecordContext::ALL, true);
    a->raw_delete(p2);
    a->emptyCache({0, 0});
    auto s7 = take_snapshot(a);
    print_trace("empty_cache", s7.device_traces[0]);
    const auto a7 = actions(s7.device_traces[0]);
    EXPECT(a7.size() >= 3 && a7[0] == Act::FREE_REQUESTED && a7[1] == Act::FREE_COMPLETED &&
           a7[2] == Act::SEGMENT_FREE);
    if (a7.size() >= 3) {
      const auto& sf = s7.device_traces[0][2];
      EXPECT(sf.size_ == arena_bytes &&
             ctx_id(sf.context_) > ctx_id(s7.device_traces[0][0].context_));
    }
    EXPECT(s7.segments.empty());

    // off: isHistoryEnabled false, traces gone, nothing recorded or gathered any more
    c10::DataPtr kept = a->allocate(700);
    record_history(a, false, 0, cca::RecordContext::NEVER, false);
    EXPECT(!a->isHistoryEnabled());
    const int made_off = g_ctx_made;
    {
      c10::DataPtr d = a->allocate(3000);
    }
    auto s8 = take_snapshot(a);
    EXPECT(s8.device_traces.size() == 1 && s8.device_traces[0].empty());
    EXPECT(g_ctx_made == made_off && live_ctx(s8, &n_live) == 0 && n_live == 1);
    bool ctx_left = false;
    for (const auto& sg : s8.segments) {
      ctx_left |= sg.context_when_allocated != nullptr;
      for (const auto& b : sg.blocks) ctx_left |= b.context_when_allocated != nullptr;
    }
    EXPECT(!ctx_left);
    kept.clear();

    // a trace tracker: every entry, with history off, none kept in the traces
    a->attachAllocatorTraceTracker(
        [](const cca::TraceEntry& te) { g_tracked.push_back(te.action_); });
    {
      c10::DataPtr d = a->allocate(3000);
    }
    std::vector<Act> tracked;
    for (Act t : g_tracked) {
      if (t != Act::SEGMENT_ALLOC) tracked.push_back(t);
    }
    EXPECT(tracked == (std::vector<Act>{Act::ALLOC, Act::FREE_REQUESTED, Act::FREE_COMPLETED}));
    EXPECT(!a->isHistoryEnabled() && take_snapshot(a).device_traces[0].empty());
  }
  a->emptyCache({0, 0});
  auto st2 = a->getDeviceStats(0);
  EXPECT(st2.allocation[0].current == 0);
  ipc_lifetime_checks(argv[0], lib, conf, h);
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures ? 1 : 0;
}
