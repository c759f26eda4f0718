// kv_bench: one process, one run, the same seeded vLLM-like KV trace replayed through
//   (a) gpu-arena's C API on the cuda backend (libgpu_arena.so, dlopen'ed from $GPU_ARENA_LIB),
//   (b) cuMemAlloc / cuMemFree,
//   (c) cuMemAllocAsync / cuMemFreeAsync on the device's default pool (release threshold max),
//   (d) PyTorch's CUDA caching allocator (c10 raw_alloc_with_stream / raw_delete),
// cold (first replay) and warm (second replay on the same allocator), then the warm
// alloc+free pair latency of 2 MiB through each, on one thread and on N threads, and the
// thread scaling (T = 1, 2, 4, 8; 2 MiB and mixed-size pairs) of (a), (c) and (d):
// kv_threads.h.
//
// The trace file comes from `kv_trace_dump` (bench/src/trace_file.rs has the format).
// Build and run with bench/gpu/run.sh; see bench/gpu/README.md.
//
// Nothing touches the memory: this measures allocation only. No per-op timing: each figure
// is the wall time of a whole loop divided by its op count.

#include <cuda.h>
#include <dlfcn.h>

#include "gpu_arena.h"

#ifndef KV_BENCH_NO_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#ifndef KV_TORCH_VERSION
#define KV_TORCH_VERSION "unknown"
#endif

namespace {

using Clock = std::chrono::steady_clock;

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void logf(const char* fmt, ...) {
  static const Clock::time_point start = Clock::now();
  std::fprintf(stderr, "[kv_bench %8.2fs] ", secs(Clock::now() - start));
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

std::string strf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "kv_bench: %s\n", msg.c_str());
  std::exit(2);
}

std::string cu_err(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  return strf("%s (%d): %s", name ? name : "?", static_cast<int>(r), text ? text : "?");
}

#define CU_CHECK(call)                                                              \
  do {                                                                              \
    CUresult cu_check_r_ = (call);                                                  \
    if (cu_check_r_ != CUDA_SUCCESS)                                                \
      die(strf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call,                   \
               cu_err(cu_check_r_).c_str()));                                       \
  } while (0)

std::string fmt_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = b < 0 ? -b : b;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (b < 0) v = -v;
  return u == 0 ? strf("%.0f B", v) : strf("%.2f %s", v, units[u]);
}

std::string fmt_ns(double ns) {
  if (ns >= 100000.0) return strf("%.1f µs", ns / 1000.0);
  if (ns >= 100.0) return strf("%.0f ns", ns);
  return strf("%.1f ns", ns);
}

#include "kv_adapters.h"

// ---------------------------------------------------------------------------------------
// Replay.

struct ReplayOut {
  double ns_per_op = 0;
  double loop_s = 0;
  double sync_s = 0;
  uint64_t alloc_failures = 0;
  uint64_t free_failures = 0;
  int64_t used_at_peak = 0;  // free memory at phase start minus free memory at the peak-live op
};

template <class A>
ReplayOut replay(A& a, const Trace& t, std::vector<void*>& ptrs, size_t free_at_start) {
  ReplayOut out;
  std::fill(ptrs.begin(), ptrs.end(), nullptr);
  const uint64_t free_fail0 = a.free_failures;
  const Op* ops = t.ops.data();
  const size_t n = t.ops.size();
  const size_t probe = t.peak_index;
  uint64_t fails = 0;
  Clock::duration excluded{0};
  const Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    const Op& op = ops[i];
    if (op.kind == 0) {
      void* p = a.alloc(op.bytes, op.stream);
      if (p == nullptr) ++fails;
      ptrs[op.id] = p;
    } else {
      void* p = ptrs[op.id];
      if (p != nullptr) {
        a.free(p, op.bytes, op.stream);
        ptrs[op.id] = nullptr;
      }
    }
    if (i == probe) {  // one cuMemGetInfo at the peak-live op, its time left out
      const Clock::time_point p0 = Clock::now();
      size_t fr = 0, tot = 0;
      if (cuMemGetInfo(&fr, &tot) == CUDA_SUCCESS)
        out.used_at_peak = static_cast<int64_t>(free_at_start) - static_cast<int64_t>(fr);
      excluded += Clock::now() - p0;
    }
  }
  const Clock::time_point t1 = Clock::now();
  CU_CHECK(cuCtxSynchronize());
  out.sync_s = secs(Clock::now() - t1);
  out.loop_s = secs(t1 - t0 - excluded);
  out.ns_per_op = out.loop_s * 1e9 / static_cast<double>(n ? n : 1);
  out.alloc_failures = fails;
  out.free_failures = a.free_failures - free_fail0;
  return out;
}

struct Row {
  std::string name;
  bool ran = false;
  std::string why_not;  // when !ran
  ReplayOut cold, warm;
  int64_t peak_reserved_cold = -1, peak_reserved = -1;
  std::string peak_note;
  int64_t held_phase = 0;   // free before this allocator was touched minus free after teardown
  int64_t held_global = 0;  // process baseline free minus free after teardown
  std::vector<std::string> notes;
  bool failed = false;
};

// Runs one allocator's phase: prepare (runtime initialized, cache emptied again), cold
// replay, warm replay, checks, teardown. Hooks are plain lambdas.
template <class A, class Prepare, class Peak, class Check, class Teardown>
Row run_phase(const std::string& label, A& a, const Trace& t, size_t baseline_free, Prepare prepare,
              Peak peak, Check check, Teardown teardown) {
  Row row;
  row.name = label;
  const char* name = label.c_str();
  std::vector<void*> ptrs(t.allocs, nullptr);
  make_current();
  const size_t free0 = mem_free();
  logf("%s: prepare", name);
  prepare(row);
  const size_t free_start = mem_free();
  logf("%s: cold replay of %zu ops", name, t.ops.size());
  row.cold = replay(a, t, ptrs, free_start);
  row.peak_reserved_cold = peak();
  logf("%s: cold %.1f ns/op (%.2fs), warm replay", name, row.cold.ns_per_op, row.cold.loop_s);
  row.warm = replay(a, t, ptrs, free_start);
  row.peak_reserved = peak();
  logf("%s: warm %.1f ns/op (%.2fs)", name, row.warm.ns_per_op, row.warm.loop_s);
  check(row);
  teardown(row);
  const size_t free_end = mem_free();
  row.held_phase = static_cast<int64_t>(free0) - static_cast<int64_t>(free_end);
  row.held_global = static_cast<int64_t>(baseline_free) - static_cast<int64_t>(free_end);
  row.ran = true;
  const uint64_t fails = row.cold.alloc_failures + row.warm.alloc_failures +
                         row.cold.free_failures + row.warm.free_failures;
  if (fails) {
    row.failed = true;
    row.notes.push_back(strf("FAILURES: alloc %" PRIu64 "/%" PRIu64 " (cold/warm), free %" PRIu64
                             "/%" PRIu64,
                             row.cold.alloc_failures, row.warm.alloc_failures,
                             row.cold.free_failures, row.warm.free_failures));
  }
  logf("%s: held after teardown %s (vs phase start), %s (vs process baseline)", name,
       fmt_bytes(static_cast<double>(row.held_phase)).c_str(),
       fmt_bytes(static_cast<double>(row.held_global)).c_str());
  return row;
}

// ---------------------------------------------------------------------------------------
// Pair latency and thread scaling: kv_threads.h (pair_bench, the fixed and mixed workloads,
// scaling_bench, scaling_markdown).

#include "kv_threads.h"

#ifndef KV_BENCH_NO_TORCH
#include "kv_interleave.h"
#endif

struct PairRow {
  std::string name;
  PairOut one, many;
  std::string note;
};

// ---------------------------------------------------------------------------------------
// Options.

struct Options {
  std::string trace, out;
  int device = 0;
  std::string skip;  // comma list of: gpu-arena, cumemalloc, async, torch
  std::string arena_conf = "backend=cuda";
  uint64_t pairs = 1000000, thread_pairs = 200000, warmup = 10000;
  uint64_t cumem_pairs = 2000, cumem_thread_pairs = 250;
  int threads = 8;
  size_t pair_bytes = 2u << 20;
  bool no_pairs = false, no_replay = false, no_scaling = false;
  std::vector<int> scaling_threads = {1, 2, 4, 8};
  // Per thread. gpu-arena's default is longer: its 8-thread loop of 100k pairs lasted ~6 ms,
  // so one scheduler hiccup moved its ratio by a third (PyTorch's takes seconds as it is).
  uint64_t scaling_pairs = 100000, arena_scaling_pairs = 2000000;
  size_t interleave = 0;  // ops per turn of the interleaved replay; 0: not run
};

const char* kUsage =
    "usage: kv_bench --trace FILE [--out FILE.md] [--device N] [--skip LIST]\n"
    "                [--arena-conf STR] [--pairs N] [--thread-pairs N] [--threads N]\n"
    "                [--warmup N] [--pair-bytes N] [--cumem-pairs N] [--cumem-thread-pairs N]\n"
    "                [--no-pairs] [--no-replay] [--no-scaling] [--scaling-threads 1,2,4,8]\n"
    "                [--scaling-pairs N] [--arena-scaling-pairs N] [--interleave N]\n"
    "  LIST: comma-separated among gpu-arena,cumemalloc,async,torch\n";

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) die(strf("%s needs a value\n%s", argv[i], kUsage));
    return argv[++i];
  };
  auto num = [&](int& i) -> uint64_t {
    std::string v = need(i);
    char* end = nullptr;
    unsigned long long x = std::strtoull(v.c_str(), &end, 0);
    if (end == v.c_str() || *end) die(strf("bad number %s\n%s", v.c_str(), kUsage));
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--trace") o.trace = need(i);
    else if (a == "--out") o.out = need(i);
    else if (a == "--device") o.device = static_cast<int>(num(i));
    else if (a == "--skip") o.skip = "," + need(i) + ",";
    else if (a == "--arena-conf") o.arena_conf = need(i);
    else if (a == "--pairs") o.pairs = num(i);
    else if (a == "--thread-pairs") o.thread_pairs = num(i);
    else if (a == "--threads") o.threads = static_cast<int>(num(i));
    else if (a == "--warmup") o.warmup = num(i);
    else if (a == "--pair-bytes") o.pair_bytes = num(i);
    else if (a == "--cumem-pairs") o.cumem_pairs = num(i);
    else if (a == "--cumem-thread-pairs") o.cumem_thread_pairs = num(i);
    else if (a == "--no-pairs") o.no_pairs = true;
    else if (a == "--no-replay") o.no_replay = true;
    else if (a == "--no-scaling") o.no_scaling = true;
    else if (a == "--scaling-pairs") o.scaling_pairs = num(i);
    else if (a == "--arena-scaling-pairs") o.arena_scaling_pairs = num(i);
    else if (a == "--interleave") o.interleave = num(i);
    else if (a == "--scaling-threads") {
      o.scaling_threads.clear();
      std::string v = need(i);
      for (size_t k = 0; k < v.size();) {
        size_t e = v.find(',', k);
        if (e == std::string::npos) e = v.size();
        const int t = std::atoi(v.substr(k, e - k).c_str());
        if (t < 1 || t > 256) die(strf("--scaling-threads: %s is not 1..256\n%s", v.c_str(), kUsage));
        o.scaling_threads.push_back(t);
        k = e + 1;
      }
    }
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (o.trace.empty() && !a.empty() && a[0] != '-') o.trace = a;
    else die(strf("unknown argument %s\n%s", a.c_str(), kUsage));
  }
  if (o.trace.empty() && !o.no_replay) die(strf("no trace file\n%s", kUsage));
  if (o.threads < 1 || o.threads > 256) die("--threads must be 1..256");
  return o;
}

bool skipped(const Options& o, const char* name) {
  return o.skip.find(std::string(",") + name + ",") != std::string::npos;
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char b[64];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return b;
}

}  // namespace

// ---------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);
  bool any_failure = false;

  // The device and its primary context (what cudart, torch and gpu-arena all use).
  CU_CHECK(cuInit(0));
  int ndev = 0;
  CU_CHECK(cuDeviceGetCount(&ndev));
  if (opt.device < 0 || opt.device >= ndev) die(strf("--device %d but %d devices", opt.device, ndev));
  g_dev.ordinal = opt.device;
  CU_CHECK(cuDeviceGet(&g_dev.dev, opt.device));
  CU_CHECK(cuDevicePrimaryCtxRetain(&g_dev.ctx, g_dev.dev));
  make_current();
  char name[256] = {0};
  CU_CHECK(cuDeviceGetName(name, sizeof name - 1, g_dev.dev));
  g_dev.name = name;
  CU_CHECK(cuDeviceTotalMem(&g_dev.total, g_dev.dev));
  CU_CHECK(cuDriverGetVersion(&g_dev.driver_version));
  const size_t baseline_free = mem_free();
  logf("device %d: %s, %s total, %s free at baseline, driver %d", opt.device, g_dev.name.c_str(),
       fmt_bytes(static_cast<double>(g_dev.total)).c_str(),
       fmt_bytes(static_cast<double>(baseline_free)).c_str(), g_dev.driver_version);

  Trace trace;
  if (!opt.no_replay) {
    trace = load_trace(opt.trace);
    logf("trace %s: %" PRIu64 " ops, %" PRIu64 " allocs, %" PRIu64 " streams, peak live %s in %" PRIu64
         " allocs (at op %zu)",
         opt.trace.c_str(), trace.op_count, trace.allocs, trace.streams,
         fmt_bytes(static_cast<double>(trace.peak_live_bytes)).c_str(), trace.peak_live_allocs,
         trace.peak_index);
  }

  CUmemoryPool pool = nullptr;
  CU_CHECK(cuDeviceGetDefaultMemPool(&pool, g_dev.dev));
  {
    cuuint64_t threshold = UINT64_MAX;  // keep freed memory in the pool (ANCHORS.md's setting)
    CU_CHECK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  }

  // gpu-arena is loaded (and initialized) first, for the whole run.
  std::string ga_skip;
  if (skipped(opt, "gpu-arena")) ga_skip = "skipped (--skip)";
  else {
    g_ga = load_gpu_arena(ndev, opt.arena_conf);
    if (!g_ga.ok()) {
      ga_skip = "unavailable: " + g_ga.error;
      any_failure = true;
      logf("gpu-arena: %s", ga_skip.c_str());
    } else {
      logf("gpu-arena: %s, configured \"%s\", backend %s", g_ga.path.c_str(), opt.arena_conf.c_str(),
           g_ga.backend_name());
    }
  }

  std::string torch_skip;
  std::string torch_name = "-";
#ifdef KV_BENCH_NO_TORCH
  torch_skip = "not built (KV_BENCH_NO_TORCH: see the build log)";
#else
  if (skipped(opt, "torch")) torch_skip = "skipped (--skip)";
  else {
    try {
      c10::cuda::set_device(torch_dev());
      tca::init(static_cast<int>(c10::cuda::device_count()));
      torch_name = tca::get()->name();
      if (torch_name != "native")
        logf("torch: allocator backend is \"%s\" (PYTORCH_CUDA_ALLOC_CONF=%s), not the native caching allocator",
             torch_name.c_str(), std::getenv("PYTORCH_CUDA_ALLOC_CONF") ? std::getenv("PYTORCH_CUDA_ALLOC_CONF") : "");
    } catch (const std::exception& e) {
      torch_skip = std::string("init failed: ") + e.what();
      any_failure = true;
    }
    make_current();
  }
#endif

  const std::string ga_label =
      std::string("gpu-arena (C API, ") + (ga_skip.empty() ? g_ga.backend_name() : "cuda") + ")";
  std::vector<Row> rows;
  const size_t ns = static_cast<size_t>(trace.streams);

  if (!opt.no_replay) {
    // (a) gpu-arena
    if (ga_skip.empty()) {
      GpuArenaAdapter a;
      gpu_arena_stats_t before{};
      rows.push_back(run_phase(
          ga_label, a, trace, baseline_free,
          [&](Row&) {
            for (CUstream s : make_streams(ns)) a.streams.push_back(reinterpret_cast<void*>(s));
            void* p = g_ga.malloc(4096, g_dev.ordinal, a.streams[0]);
            if (p) g_ga.free(p, 4096, g_dev.ordinal, a.streams[0]);
            if (g_ga.empty_cache(-1) != GPU_ARENA_OK) logf("gpu_arena_empty_cache: %s", g_ga.last_error());
            before = ga_stats();
          },
          [&]() { return static_cast<int64_t>(ga_stats().peak_reserved_bytes); },
          [&](Row& r) {
            gpu_arena_stats_t s = ga_stats();
            const uint64_t allocs = s.alloc_count - before.alloc_count;
            const uint64_t frees = s.free_count - before.free_count;
            r.notes.push_back(strf("%" PRIu64 " allocs and %" PRIu64 " frees served (trace: 2 x %" PRIu64
                                   "), %" PRIu64 " live after, %" PRIu64 " arenas held, %" PRIu64
                                   " arena creates, %" PRIu64 " destroys, peak allocated %s",
                                   allocs, frees, trace.allocs, s.allocations, s.arenas,
                                   s.backend_creates - before.backend_creates,
                                   s.backend_destroys - before.backend_destroys,
                                   fmt_bytes(static_cast<double>(s.peak_allocated_bytes)).c_str()));
            if (allocs != 2 * trace.allocs)
              r.notes.push_back("note: alloc_count moved by a different number than the trace's allocations");
            if (s.allocations != 0 || frees != 2 * trace.allocs) {
              r.failed = true;
              r.notes.push_back("FAILURE: counts do not match the trace (a free was refused?): " +
                                std::string(g_ga.last_error()));
            }
            const int v = g_ga.validate(g_dev.ordinal);
            r.notes.push_back(v == GPU_ARENA_OK ? "gpu_arena_validate: ok"
                                                : "FAILURE: gpu_arena_validate: " + std::string(g_ga.last_error()));
            if (v != GPU_ARENA_OK) r.failed = true;
            r.notes.push_back("peak reserved = gpu_arena_stats().peak_reserved_bytes (lifetime high-water mark)");
          },
          [&](Row& r) {
            if (g_ga.empty_cache(-1) != GPU_ARENA_OK) {
              r.notes.push_back("FAILURE: gpu_arena_empty_cache: " + std::string(g_ga.last_error()));
              r.failed = true;
            }
            gpu_arena_stats_t s = ga_stats();
            r.notes.push_back(strf("after empty_cache: reserved %s, %" PRIu64 " arenas",
                                   fmt_bytes(static_cast<double>(s.reserved_bytes)).c_str(), s.arenas));
          }));
    } else {
      Row r;
      r.name = ga_label;
      r.why_not = ga_skip;
      rows.push_back(r);
    }

    // (b) cuMemAlloc / cuMemFree
    if (!skipped(opt, "cumemalloc")) {
      CuMemAllocAdapter a;
      rows.push_back(run_phase(
          "cuMemAlloc / cuMemFree", a, trace, baseline_free,
          [&](Row&) {
            CUdeviceptr d = 0;
            CU_CHECK(cuMemAlloc(&d, 4096));
            CU_CHECK(cuMemFree(d));
          },
          [&]() { return static_cast<int64_t>(trace.peak_live_bytes); },
          [&](Row& r) {
            r.peak_note = "= peak live (no cache)";
            r.notes.push_back("peak reserved = the trace's peak live (nothing is cached); the driver's own "
                              "rounding shows in 'device used at peak-live op'");
          },
          [&](Row&) {}));
    } else {
      Row r;
      r.name = "cuMemAlloc / cuMemFree";
      r.why_not = "skipped (--skip)";
      rows.push_back(r);
    }

    // (c) cuMemAllocAsync on the default pool
    if (!skipped(opt, "async")) {
      CuAsyncAdapter a;
      rows.push_back(run_phase(
          "cuMemAllocAsync (default pool, threshold max)", a, trace, baseline_free,
          [&](Row&) {
            a.streams = make_streams(ns);
            CUdeviceptr d = 0;
            CU_CHECK(cuMemAllocAsync(&d, 4096, a.streams[0]));
            CU_CHECK(cuMemFreeAsync(d, a.streams[0]));
            CU_CHECK(cuCtxSynchronize());
            CU_CHECK(cuMemPoolTrimTo(pool, 0));
            cuuint64_t zero = 0;
            CU_CHECK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &zero));
          },
          [&]() {
            cuuint64_t v = 0;
            CU_CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &v));
            return static_cast<int64_t>(v);
          },
          [&](Row& r) {
            cuuint64_t cur = 0;
            CU_CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &cur));
            r.notes.push_back(strf("pool reserved before trim %s; peak reserved = CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH",
                                   fmt_bytes(static_cast<double>(cur)).c_str()));
          },
          [&](Row&) {
            CU_CHECK(cuCtxSynchronize());
            CU_CHECK(cuMemPoolTrimTo(pool, 0));
          }));
    } else {
      Row r;
      r.name = "cuMemAllocAsync (default pool, threshold max)";
      r.why_not = "skipped (--skip)";
      rows.push_back(r);
    }

    // (d) PyTorch's caching allocator, last.
#ifndef KV_BENCH_NO_TORCH
    if (torch_skip.empty()) {
      TorchAdapter a;
      rows.push_back(run_phase(
          "PyTorch CUDACachingAllocator", a, trace, baseline_free,
          [&](Row&) {
            for (CUstream s : make_streams(ns)) a.streams.push_back(reinterpret_cast<cudaStream_t>(s));
            // Initialize cudart and the allocator, then give the memory back: cold = cache empty.
            void* p = a.alloc(4096, 0);
            if (p) a.free(p, 4096, 0);
            tca::emptyCache();
            tca::resetPeakStats(torch_dev());
            make_current();
          },
          [&]() { return static_cast<int64_t>(torch_peak_reserved()); },
          [&](Row& r) {
            r.notes.push_back(strf("allocator \"%s\"; reserved before emptyCache %s; peak reserved = "
                                   "getDeviceStats().reserved_bytes[AGGREGATE].peak",
                                   torch_name.c_str(), fmt_bytes(static_cast<double>(torch_reserved())).c_str()));
            if (!g_torch_last_error.empty()) r.notes.push_back("last torch error: " + g_torch_last_error);
          },
          [&](Row& r) {
            tca::emptyCache();
            make_current();
            r.notes.push_back(strf("after emptyCache: reserved %s", fmt_bytes(static_cast<double>(torch_reserved())).c_str()));
          }));
    } else
#endif
    {
      Row r;
      r.name = "PyTorch CUDACachingAllocator";
      r.why_not = torch_skip;
      rows.push_back(r);
    }
  }

  // gpu-arena and PyTorch replaying in turns (kv_interleave.h), when asked for.
  std::string interleaved_md;
#ifndef KV_BENCH_NO_TORCH
  if (!opt.no_replay && opt.interleave > 0) {
    InterleavedOut il;
    il.chunk = opt.interleave;
    if (!ga_skip.empty() || !torch_skip.empty()) il.why_not = "needs both gpu-arena and PyTorch";
    else il = run_interleaved(trace, ns, opt.interleave);
    any_failure = any_failure || il.failed;
    interleaved_md = interleaved_markdown(il, ga_label);
  }
#endif

  // Item 5: warm pair latency; item 6: thread scaling (kv_threads.h).
  std::vector<PairRow> prow;
  std::vector<ScalingRow> srow;
  if (!opt.no_pairs) {
    const size_t B = opt.pair_bytes;
    const int N = opt.threads;
    auto no_init = [] {};
    auto scale = [&](const std::string& name, uint64_t pairs, auto init, auto al, auto fr) {
      ScalingRow sr;
      sr.name = name;
      if (opt.no_scaling) return;
      logf("scaling %s: threads", name.c_str());
      sr.points = scaling_bench(opt.scaling_threads, pairs, std::min<uint64_t>(opt.warmup, pairs), B, make_streams,
                                init, al, fr);
      for (const auto& p : sr.points)
        if (p.fixed.failures || p.mixed.failures) any_failure = true;
      srow.push_back(sr);
    };
    auto both = [&](PairRow& r, uint64_t p1, uint64_t pn, auto init, auto al, auto fr) {
      logf("pairs %s: 1 thread x %" PRIu64, r.name.c_str(), p1);
      r.one = pair_bench(1, p1, std::min<uint64_t>(opt.warmup, p1), B, make_streams(1), init, al, fr);
      logf("pairs %s: %.1f ns/pair; %d threads x %" PRIu64, r.name.c_str(), r.one.ns_per_pair_mean, N, pn);
      r.many = pair_bench(N, pn, std::min<uint64_t>(opt.warmup, pn), B, make_streams(N), init, al, fr);
      logf("pairs %s: %.1f ns/pair/thread, %.0f pairs/s", r.name.c_str(), r.many.ns_per_pair_mean,
           r.many.pairs_per_s);
      if (r.one.failures || r.many.failures) any_failure = true;
    };
    {
      PairRow r;
      r.name = ga_label;
      if (ga_skip.empty()) {
        auto al = [](size_t b, CUstream s) { return g_ga.malloc(static_cast<ssize_t>(b), g_dev.ordinal, s); };
        auto fr = [](void* p, size_t b, CUstream s) {
          g_ga.free(p, static_cast<ssize_t>(b), g_dev.ordinal, s);
          return true;
        };
        both(r, opt.pairs, opt.thread_pairs, no_init, al, fr);
        g_ga.empty_cache(-1);
        scale(r.name, opt.arena_scaling_pairs, no_init, al, fr);
        g_ga.empty_cache(-1);
      } else {
        r.one.why_not = ga_skip;
      }
      prow.push_back(r);
    }
#ifndef KV_BENCH_NO_TORCH
    {
      PairRow r;
      r.name = "PyTorch CUDACachingAllocator";
      if (torch_skip.empty()) {
        auto init = [] { c10::cuda::set_device(torch_dev()); };
        auto al = [](size_t b, CUstream s) -> void* {
          try {
            return tca::raw_alloc_with_stream(b, reinterpret_cast<cudaStream_t>(s));
          } catch (const std::exception&) {
            return nullptr;
          }
        };
        auto fr = [](void* p, size_t, CUstream) {
          try {
            tca::raw_delete(p);
            return true;
          } catch (const std::exception&) {
            return false;
          }
        };
        both(r, opt.pairs, opt.thread_pairs, init, al, fr);
        tca::emptyCache();
        make_current();
        scale(r.name, opt.scaling_pairs, init, al, fr);
        tca::emptyCache();
        make_current();
      } else {
        r.one.why_not = torch_skip;
      }
      prow.push_back(r);
    }
#else
    {
      PairRow r;
      r.name = "PyTorch CUDACachingAllocator";
      r.one.why_not = torch_skip;
      prow.push_back(r);
    }
#endif
    if (!skipped(opt, "async")) {
      PairRow r;
      r.name = "cuMemAllocAsync (default pool, threshold max)";
      auto al = [](size_t b, CUstream s) -> void* {
        CUdeviceptr d = 0;
        return cuMemAllocAsync(&d, b, s) == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
      };
      auto fr = [](void* p, size_t, CUstream s) {
        return cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), s) == CUDA_SUCCESS;
      };
      both(r, opt.pairs, opt.thread_pairs, no_init, al, fr);
      CU_CHECK(cuMemPoolTrimTo(pool, 0));
      scale(r.name, opt.scaling_pairs, no_init, al, fr);
      CU_CHECK(cuMemPoolTrimTo(pool, 0));
      prow.push_back(r);
    }
    if (!skipped(opt, "cumemalloc")) {
      PairRow r;
      r.name = "cuMemAlloc / cuMemFree";
      both(r, opt.cumem_pairs, opt.cumem_thread_pairs, no_init,
           [](size_t b, CUstream) -> void* {
             CUdeviceptr d = 0;
             return cuMemAlloc(&d, b) == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
           },
           [](void* p, size_t, CUstream) { return cuMemFree(reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS; });
      r.note = "fewer pairs (--cumem-pairs, --cumem-thread-pairs): each is a driver call";
      prow.push_back(r);
    }
  }

  // ---- Report.
  std::string md;
  md += "# KV trace replay and pair latency on the GPU (kv_bench, one run)\n\n";
  md += strf("- date: %s\n", utc_now().c_str());
  md += strf("- device %d: %s, %s, driver API version %d\n", g_dev.ordinal, g_dev.name.c_str(),
             fmt_bytes(static_cast<double>(g_dev.total)).c_str(), g_dev.driver_version);
  md += strf("- gpu-arena: %s, configure \"%s\"\n", g_ga.path.empty() ? "-" : g_ga.path.c_str(),
             opt.arena_conf.c_str());
  md += strf("- torch: %s (c10 caching allocator \"%s\", PYTORCH_CUDA_ALLOC_CONF=%s)\n", KV_TORCH_VERSION,
             torch_name.c_str(),
             std::getenv("PYTORCH_CUDA_ALLOC_CONF") ? std::getenv("PYTORCH_CUDA_ALLOC_CONF") : "unset");
  if (!opt.no_replay) {
    md += strf("- trace: %s, seed %#" PRIx64 ", %" PRIu64 " requests: %" PRIu64 " ops, %" PRIu64
               " allocations, %" PRIu64 " streams (each allocator gets its own non-blocking streams), peak "
               "live %s (%" PRIu64 " B) in %" PRIu64 " allocations\n",
               trace.path.c_str(), trace.seed, trace.requests, trace.op_count, trace.allocs, trace.streams,
               fmt_bytes(static_cast<double>(trace.peak_live_bytes)).c_str(), trace.peak_live_bytes,
               trace.peak_live_allocs);
    md += strf("- process baseline free memory (primary context created, before any allocator): %s\n",
               fmt_bytes(static_cast<double>(baseline_free)).c_str());
    md += "\nOrder: gpu-arena, cuMemAlloc, cuMemAllocAsync, PyTorch. Cold = first replay (runtime "
          "initialized, cache empty), warm = the same allocator replaying the trace again. ns/op = wall "
          "time of the op loop / ops (one cuMemGetInfo at the peak-live op is left out). Held after "
          "teardown = free memory before that allocator was first touched minus free memory after its "
          "teardown (free everything, then gpu_arena_empty_cache / cuMemPoolTrimTo(0) / emptyCache).\n\n";

    double torch_warm = 0;
    for (const auto& r : rows)
      if (r.ran && r.name.rfind("PyTorch", 0) == 0) torch_warm = r.warm.ns_per_op;
    md += "| allocator | cold ns/op | warm ns/op | peak reserved | reserved/live | held after teardown | "
          "speedup vs torch (warm) | device used at peak-live op | held vs process baseline | failures |\n";
    md += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
    for (const auto& r : rows) {
      if (!r.ran) {
        md += strf("| %s | - | - | - | - | - | - | - | - | %s |\n", r.name.c_str(), r.why_not.c_str());
        any_failure = any_failure || r.why_not.find("skipped") == std::string::npos;
        continue;
      }
      const double ratio = static_cast<double>(r.peak_reserved) / static_cast<double>(trace.peak_live_bytes);
      const std::string speed = torch_warm > 0 ? strf("%.2fx", torch_warm / r.warm.ns_per_op) : "-";
      const uint64_t fails = r.cold.alloc_failures + r.warm.alloc_failures + r.cold.free_failures +
                             r.warm.free_failures;
      md += strf("| %s | %s | %s | %s%s | %.3f | %s | %s | %s | %s | %s |\n", r.name.c_str(),
                 fmt_ns(r.cold.ns_per_op).c_str(), fmt_ns(r.warm.ns_per_op).c_str(),
                 fmt_bytes(static_cast<double>(r.peak_reserved)).c_str(),
                 r.peak_note.empty() ? "" : (" " + r.peak_note).c_str(), ratio,
                 fmt_bytes(static_cast<double>(r.held_phase)).c_str(), speed.c_str(),
                 fmt_bytes(static_cast<double>(r.cold.used_at_peak)).c_str(),
                 fmt_bytes(static_cast<double>(r.held_global)).c_str(),
                 fails ? strf("%" PRIu64, fails).c_str() : (r.failed ? "see notes" : "0"));
      any_failure = any_failure || r.failed;
    }
    md += "\nDetails:\n\n";
    for (const auto& r : rows) {
      if (!r.ran) continue;
      md += strf("- **%s**: cold %.3fs loop + %.3fs sync, warm %.3fs loop + %.3fs sync; peak reserved after "
                 "cold %s (%.3f x live), after warm %s; device used at the peak-live op: cold %s, warm %s",
                 r.name.c_str(), r.cold.loop_s, r.cold.sync_s, r.warm.loop_s, r.warm.sync_s,
                 fmt_bytes(static_cast<double>(r.peak_reserved_cold)).c_str(),
                 static_cast<double>(r.peak_reserved_cold) / static_cast<double>(trace.peak_live_bytes),
                 fmt_bytes(static_cast<double>(r.peak_reserved)).c_str(),
                 fmt_bytes(static_cast<double>(r.cold.used_at_peak)).c_str(),
                 fmt_bytes(static_cast<double>(r.warm.used_at_peak)).c_str());
      for (const auto& n : r.notes) md += "; " + n;
      md += ".\n";
    }
  }

  md += interleaved_md;
  if (!prow.empty()) {
    md += strf("\n## Warm alloc+free pair latency, %s, each thread on its own non-blocking stream\n\n",
               fmt_bytes(static_cast<double>(opt.pair_bytes)).c_str());
    md += strf("After %" PRIu64 " warm-up pairs per thread (fewer when a run has fewer pairs); threads start "
               "together; ns/pair = a thread's loop time / its pairs; pairs/s = all pairs / (last end - first "
               "start).\n\n",
               opt.warmup);
    md += strf("| allocator | 1 thread: ns/pair | pairs | %d threads: ns/pair/thread (mean) | max | pairs/thread "
               "| aggregate pairs/s | failures | notes |\n",
               opt.threads);
    md += "|---|---:|---:|---:|---:|---:|---:|---:|---|\n";
    for (const auto& r : prow) {
      if (!r.one.ran) {
        md += strf("| %s | - | - | - | - | - | - | - | %s |\n", r.name.c_str(), r.one.why_not.c_str());
        continue;
      }
      md += strf("| %s | %s | %" PRIu64 " | %s | %s | %" PRIu64 " | %.3g | %" PRIu64 " | %s |\n", r.name.c_str(),
                 fmt_ns(r.one.ns_per_pair_mean).c_str(), r.one.pairs_per_thread,
                 fmt_ns(r.many.ns_per_pair_mean).c_str(), fmt_ns(r.many.ns_per_pair_max).c_str(),
                 r.many.pairs_per_thread, r.many.pairs_per_s, r.one.failures + r.many.failures, r.note.c_str());
    }
  }
  if (!srow.empty())
    md += scaling_markdown(srow, std::min<uint64_t>(opt.warmup, opt.scaling_pairs), opt.pair_bytes);
  md += strf("\nResult: %s\n", any_failure ? "FAILURES (see the table and notes)" : "no failures");

  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  if (!opt.out.empty()) {
    FILE* f = std::fopen(opt.out.c_str(), "w");
    if (!f) die(strf("cannot write %s: %s", opt.out.c_str(), std::strerror(errno)));
    std::fputs(md.c_str(), f);
    std::fclose(f);
    logf("wrote %s", opt.out.c_str());
  }
  return any_failure ? 1 : 0;
}
