// The native torch allocator (python/gpu_arena/native/allocator.cpp) without a GPU and
// without libtorch_cuda: compiled into this program with a torch wheel's headers, linked to
// its libc10 and libc10_cuda, run over gpu-arena's sim backend. The CUDA runtime calls c10
// makes are defined here (this executable's definitions come first in symbol lookup, so they
// stand in for libcudart's), and so is torch's changeCurrentAllocator (libtorch_cuda's; what
// it does: refuse when the current allocator is initialized, keep and store the new one).
// Built and run by scripts/check-torch-native.sh. Usage: harness LIBGPU_ARENA [CONF]
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

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
static int failures = 0, passes = 0;
#define EXPECT(c)                                     \
  do {                                                \
    if (c) {                                          \
      ++passes;                                       \
    } else {                                          \
      ++failures;                                     \
      std::printf("FAIL line %d: %s\n", __LINE__, #c); \
    }                                                 \
  } while (0)

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  c10::cuda::_internal::setHasPrimaryContext([](c10::DeviceIndex) { return true; });
  const char* lib = argv[1];
  void* h = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
  auto configure = reinterpret_cast<int (*)(const char*)>(dlsym(h, "gpu_arena_configure"));
  EXPECT(configure(argc > 2 ? argv[2] : "backend=sim,max_reserved=256MiB,arena_size=64MiB") == 0);
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
  a->emptyCache({0, 0});
  auto st2 = a->getDeviceStats(0);
  EXPECT(st2.allocation[0].current == 0);
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures ? 1 : 0;
}
