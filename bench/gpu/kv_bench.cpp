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

#include "gpu_arena.h"

#ifndef KV_BENCH_NO_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <string>
#include <vector>

#include "kv_adapters.h"  // the trace file, the device, the allocators as replay adapters
#include "kv_common.h"    // Clock, logf, strf, fmt_bytes, fmt_ns, die, CU_CHECK
#include "kv_replay.h"    // replay, run_phase, Row
#include "kv_threads.h"   // pair_bench, scaling_bench, scaling_markdown
#ifndef KV_BENCH_NO_TORCH
#include "kv_interleave.h"  // run_interleaved, interleaved_markdown
#endif

#ifndef KV_TORCH_VERSION
#define KV_TORCH_VERSION "unknown"
#endif

namespace {

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

// Every option, with its default (Options above).
const char* kUsage =
    "usage: kv_bench --trace FILE [options]     (FILE may also be the first bare argument)\n"
    "  --trace FILE             the KV trace (kv_trace_dump's KVTRACE1 file); not needed with\n"
    "                           --no-replay\n"
    "  --out FILE.md            also write the report there (it always goes to stdout)\n"
    "  --device N               the CUDA device (default 0)\n"
    "  --skip LIST              leave allocators out: comma-separated among\n"
    "                           gpu-arena,cumemalloc,async,torch\n"
    "  --arena-conf STR         gpu_arena_configure's string (default backend=cuda)\n"
    "  --no-replay              no trace replay (and no trace needed): pairs and scaling only\n"
    "  --interleave N           also replay the trace through gpu-arena and PyTorch in one loop,\n"
    "                           taking turns every N ops (kv_interleave.h; default 0: not run;\n"
    "                           needs a build with torch)\n"
    "  --no-pairs               no pair latency and no thread scaling\n"
    "  --pairs N                warm alloc+free pairs on one thread (default 1000000)\n"
    "  --thread-pairs N         pairs per thread on --threads threads (default 200000)\n"
    "  --threads N              threads of the multi-thread pair run, 1..256 (default 8)\n"
    "  --warmup N               warm-up pairs per thread before each timed loop, at most its\n"
    "                           pairs (default 10000)\n"
    "  --pair-bytes N           bytes of each pair's allocation (default 2097152: 2 MiB)\n"
    "  --cumem-pairs N          cuMemAlloc's pairs on one thread (default 2000: each is a driver\n"
    "                           call)\n"
    "  --cumem-thread-pairs N   cuMemAlloc's pairs per thread (default 250)\n"
    "  --no-scaling             no thread scaling (the pair latency still runs)\n"
    "  --scaling-threads LIST   the scaling's thread counts, comma-separated, each 1..256\n"
    "                           (default 1,2,4,8)\n"
    "  --scaling-pairs N        pairs per thread of each scaling run, PyTorch and\n"
    "                           cuMemAllocAsync (default 100000)\n"
    "  --arena-scaling-pairs N  the same for gpu-arena (default 2000000: its loops are short)\n"
    "  -h, --help               this text\n"
    "Numbers are read as C literals (0x... is hex).\n";

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) die(std::string(argv[i]) + " needs a value\n" + kUsage);
    return argv[++i];
  };
  auto num = [&](int& i) -> uint64_t {
    std::string v = need(i);
    char* end = nullptr;
    unsigned long long x = std::strtoull(v.c_str(), &end, 0);
    if (end == v.c_str() || *end) die("bad number " + v + "\n" + kUsage);
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
        if (t < 1 || t > 256) die("--scaling-threads: " + v + " is not 1..256\n" + kUsage);
        o.scaling_threads.push_back(t);
        k = e + 1;
      }
    }
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (o.trace.empty() && !a.empty() && a[0] != '-') o.trace = a;
    else die("unknown argument " + a + "\n" + kUsage);
  }
  if (o.trace.empty() && !o.no_replay) die(std::string("no trace file\n") + kUsage);
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

// ---------------------------------------------------------------------------------------
// The run: what its phases share, then the phases in the order main() runs them.

struct Run {
  Options opt;
  int ndev = 0;
  size_t baseline_free = 0;  // free memory once the primary context exists
  Trace trace;               // empty with --no-replay
  size_t ns = 0;             // streams per allocator: the trace's
  CUmemoryPool pool = nullptr;  // the device's default pool (cuMemAllocAsync)
  std::string ga_skip;          // why gpu-arena does not run ("" when it does)
  std::string torch_skip;       // why PyTorch does not run ("" when it does)
  std::string torch_name = "-";  // the c10 allocator backend's name
  std::string ga_label;         // gpu-arena's row name
  bool any_failure = false;
};

// The device and its primary context (what cudart, torch and gpu-arena all use).
void open_device(Run& run) {
  const Options& opt = run.opt;
  CU_CHECK(cuInit(0));
  int ndev = 0;
  CU_CHECK(cuDeviceGetCount(&ndev));
  if (opt.device < 0 || opt.device >= ndev) die(strf("--device %d but %d devices", opt.device, ndev));
  run.ndev = ndev;
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
  run.baseline_free = baseline_free;
  logf("device %d: %s, %s total, %s free at baseline, driver %d", opt.device, g_dev.name.c_str(),
       fmt_bytes(static_cast<double>(g_dev.total)).c_str(),
       fmt_bytes(static_cast<double>(baseline_free)).c_str(), g_dev.driver_version);
}

void read_trace(Run& run) {
  const Options& opt = run.opt;
  Trace& trace = run.trace;
  if (!opt.no_replay) {
    trace = load_trace(opt.trace);
    logf("trace %s: %" PRIu64 " ops, %" PRIu64 " allocs, %" PRIu64 " streams, peak live %s in %" PRIu64
         " allocs (at op %zu)",
         opt.trace.c_str(), trace.op_count, trace.allocs, trace.streams,
         fmt_bytes(static_cast<double>(trace.peak_live_bytes)).c_str(), trace.peak_live_allocs,
         trace.peak_index);
  }
  run.ns = static_cast<size_t>(trace.streams);
}

void open_default_pool(Run& run) {
  CUmemoryPool pool = nullptr;
  CU_CHECK(cuDeviceGetDefaultMemPool(&pool, g_dev.dev));
  {
    cuuint64_t threshold = UINT64_MAX;  // keep freed memory in the pool (ANCHORS.md's setting)
    CU_CHECK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  }
  run.pool = pool;
}

// gpu-arena is loaded (and initialized) first, for the whole run.
void open_gpu_arena(Run& run) {
  const Options& opt = run.opt;
  std::string& ga_skip = run.ga_skip;
  if (skipped(opt, "gpu-arena")) ga_skip = "skipped (--skip)";
  else {
    g_ga = load_gpu_arena(run.ndev, opt.arena_conf);
    if (!g_ga.ok()) {
      ga_skip = "unavailable: " + g_ga.error;
      run.any_failure = true;
      logf("gpu-arena: %s", ga_skip.c_str());
    } else {
      logf("gpu-arena: %s, configured \"%s\", backend %s", g_ga.path.c_str(), opt.arena_conf.c_str(),
           g_ga.backend_name());
    }
  }
  run.ga_label = std::string("gpu-arena (C API, ") + (ga_skip.empty() ? g_ga.backend_name() : "cuda") + ")";
}

void open_torch(Run& run) {
  std::string& torch_skip = run.torch_skip;
#ifdef KV_BENCH_NO_TORCH
  torch_skip = "not built (KV_BENCH_NO_TORCH: see the build log)";
#else
  std::string& torch_name = run.torch_name;
  if (skipped(run.opt, "torch")) torch_skip = "skipped (--skip)";
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
      run.any_failure = true;
    }
    make_current();
  }
#endif
}

// A row for an allocator that did not run.
Row not_run(const std::string& name, const std::string& why) {
  Row r;
  r.name = name;
  r.why_not = why;
  return r;
}

// (a) gpu-arena
Row replay_gpu_arena(Run& run) {
  const Trace& trace = run.trace;
  const size_t ns = run.ns;
  GpuArenaAdapter a;
  gpu_arena_stats_t before{};
  return run_phase(
      run.ga_label, a, trace, run.baseline_free,
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
      });
}

// (b) cuMemAlloc / cuMemFree
Row replay_cumemalloc(Run& run) {
  const Trace& trace = run.trace;
  CuMemAllocAdapter a;
  return run_phase(
      "cuMemAlloc / cuMemFree", a, trace, run.baseline_free,
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
      [&](Row&) {});
}

// (c) cuMemAllocAsync on the default pool
Row replay_async(Run& run) {
  const size_t ns = run.ns;
  CUmemoryPool pool = run.pool;
  CuAsyncAdapter a;
  return run_phase(
      "cuMemAllocAsync (default pool, threshold max)", a, run.trace, run.baseline_free,
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
      });
}

#ifndef KV_BENCH_NO_TORCH
// (d) PyTorch's caching allocator
Row replay_torch(Run& run) {
  const size_t ns = run.ns;
  const std::string& torch_name = run.torch_name;
  TorchAdapter a;
  return run_phase(
      "PyTorch CUDACachingAllocator", a, run.trace, run.baseline_free,
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
      });
}
#endif

// The trace replayed by each allocator in turn: gpu-arena, cuMemAlloc, cuMemAllocAsync,
// PyTorch last.
std::vector<Row> replay_phases(Run& run) {
  const Options& opt = run.opt;
  std::vector<Row> rows;
  if (run.ga_skip.empty()) rows.push_back(replay_gpu_arena(run));
  else rows.push_back(not_run(run.ga_label, run.ga_skip));
  if (!skipped(opt, "cumemalloc")) rows.push_back(replay_cumemalloc(run));
  else rows.push_back(not_run("cuMemAlloc / cuMemFree", "skipped (--skip)"));
  if (!skipped(opt, "async")) rows.push_back(replay_async(run));
  else rows.push_back(not_run("cuMemAllocAsync (default pool, threshold max)", "skipped (--skip)"));
#ifndef KV_BENCH_NO_TORCH
  if (run.torch_skip.empty()) rows.push_back(replay_torch(run));
  else
#endif
    rows.push_back(not_run("PyTorch CUDACachingAllocator", run.torch_skip));
  return rows;
}

// gpu-arena and PyTorch replaying in turns (kv_interleave.h), when asked for: its report
// section ("" when not asked for).
std::string interleaved_phase(Run& run) {
  std::string interleaved_md;
#ifndef KV_BENCH_NO_TORCH
  const Options& opt = run.opt;
  if (!opt.no_replay && opt.interleave > 0) {
    InterleavedOut il;
    il.chunk = opt.interleave;
    if (!run.ga_skip.empty() || !run.torch_skip.empty()) il.why_not = "needs both gpu-arena and PyTorch";
    else il = run_interleaved(run.trace, run.ns, opt.interleave);
    run.any_failure = run.any_failure || il.failed;
    interleaved_md = interleaved_markdown(il, run.ga_label);
  }
#else
  (void)run;
#endif
  return interleaved_md;
}

// Warm pairs through one allocator: on 1 thread (p1 pairs), then on --threads threads (pn
// pairs each).
template <class Init, class Alloc, class Free>
void pairs_of(Run& run, PairRow& r, uint64_t p1, uint64_t pn, Init init, Alloc al, Free fr) {
  const Options& opt = run.opt;
  const size_t B = opt.pair_bytes;
  const int N = opt.threads;
  logf("pairs %s: 1 thread x %" PRIu64, r.name.c_str(), p1);
  r.one = pair_bench(1, p1, std::min<uint64_t>(opt.warmup, p1), B, make_streams(1), init, al, fr);
  logf("pairs %s: %.1f ns/pair; %d threads x %" PRIu64, r.name.c_str(), r.one.ns_per_pair_mean, N, pn);
  r.many = pair_bench(N, pn, std::min<uint64_t>(opt.warmup, pn), B, make_streams(N), init, al, fr);
  logf("pairs %s: %.1f ns/pair/thread, %.0f pairs/s", r.name.c_str(), r.many.ns_per_pair_mean,
       r.many.pairs_per_s);
  if (r.one.failures || r.many.failures) run.any_failure = true;
}

// One allocator's thread scaling (kv_threads.h), unless --no-scaling.
template <class Init, class Alloc, class Free>
void scaling_of(Run& run, std::vector<ScalingRow>& srow, const std::string& name, uint64_t pairs,
                Init init, Alloc al, Free fr) {
  const Options& opt = run.opt;
  const size_t B = opt.pair_bytes;
  ScalingRow sr;
  sr.name = name;
  if (opt.no_scaling) return;
  logf("scaling %s: threads", name.c_str());
  sr.points = scaling_bench(opt.scaling_threads, pairs, std::min<uint64_t>(opt.warmup, pairs), B, make_streams,
                            init, al, fr);
  for (const auto& p : sr.points)
    if (p.fixed.failures || p.mixed.failures) run.any_failure = true;
  srow.push_back(sr);
}

PairRow pairs_gpu_arena(Run& run, std::vector<ScalingRow>& srow) {
  const Options& opt = run.opt;
  auto no_init = [] {};
  PairRow r;
  r.name = run.ga_label;
  if (run.ga_skip.empty()) {
    auto al = [](size_t b, CUstream s) { return g_ga.malloc(static_cast<ssize_t>(b), g_dev.ordinal, s); };
    auto fr = [](void* p, size_t b, CUstream s) {
      g_ga.free(p, static_cast<ssize_t>(b), g_dev.ordinal, s);
      return true;
    };
    pairs_of(run, r, opt.pairs, opt.thread_pairs, no_init, al, fr);
    g_ga.empty_cache(-1);
    scaling_of(run, srow, r.name, opt.arena_scaling_pairs, no_init, al, fr);
    g_ga.empty_cache(-1);
  } else {
    r.one.why_not = run.ga_skip;
  }
  return r;
}

PairRow pairs_torch(Run& run, std::vector<ScalingRow>& srow) {
  PairRow r;
  r.name = "PyTorch CUDACachingAllocator";
#ifndef KV_BENCH_NO_TORCH
  const Options& opt = run.opt;
  if (run.torch_skip.empty()) {
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
    pairs_of(run, r, opt.pairs, opt.thread_pairs, init, al, fr);
    tca::emptyCache();
    make_current();
    scaling_of(run, srow, r.name, opt.scaling_pairs, init, al, fr);
    tca::emptyCache();
    make_current();
  } else {
    r.one.why_not = run.torch_skip;
  }
#else
  (void)srow;
  r.one.why_not = run.torch_skip;
#endif
  return r;
}

PairRow pairs_async(Run& run, std::vector<ScalingRow>& srow) {
  const Options& opt = run.opt;
  auto no_init = [] {};
  PairRow r;
  r.name = "cuMemAllocAsync (default pool, threshold max)";
  auto al = [](size_t b, CUstream s) -> void* {
    CUdeviceptr d = 0;
    return cuMemAllocAsync(&d, b, s) == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
  };
  auto fr = [](void* p, size_t, CUstream s) {
    return cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), s) == CUDA_SUCCESS;
  };
  pairs_of(run, r, opt.pairs, opt.thread_pairs, no_init, al, fr);
  CU_CHECK(cuMemPoolTrimTo(run.pool, 0));
  scaling_of(run, srow, r.name, opt.scaling_pairs, no_init, al, fr);
  CU_CHECK(cuMemPoolTrimTo(run.pool, 0));
  return r;
}

PairRow pairs_cumemalloc(Run& run) {
  const Options& opt = run.opt;
  auto no_init = [] {};
  PairRow r;
  r.name = "cuMemAlloc / cuMemFree";
  pairs_of(run, r, opt.cumem_pairs, opt.cumem_thread_pairs, no_init,
           [](size_t b, CUstream) -> void* {
             CUdeviceptr d = 0;
             return cuMemAlloc(&d, b) == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
           },
           [](void* p, size_t, CUstream) { return cuMemFree(reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS; });
  r.note = "fewer pairs (--cumem-pairs, --cumem-thread-pairs): each is a driver call";
  return r;
}

// Item 5: warm pair latency; item 6: thread scaling (kv_threads.h).
void pair_phases(Run& run, std::vector<PairRow>& prow, std::vector<ScalingRow>& srow) {
  prow.push_back(pairs_gpu_arena(run, srow));
  prow.push_back(pairs_torch(run, srow));
  if (!skipped(run.opt, "async")) prow.push_back(pairs_async(run, srow));
  if (!skipped(run.opt, "cumemalloc")) prow.push_back(pairs_cumemalloc(run));
}

// ---------------------------------------------------------------------------------------
// The report (markdown, on stdout and in --out).

std::string report_header(const Run& run) {
  const Options& opt = run.opt;
  std::string md;
  md += "# KV trace replay and pair latency on the GPU (kv_bench, one run)\n\n";
  md += strf("- date: %s\n", utc_now().c_str());
  md += strf("- device %d: %s, %s, driver API version %d\n", g_dev.ordinal, g_dev.name.c_str(),
             fmt_bytes(static_cast<double>(g_dev.total)).c_str(), g_dev.driver_version);
  md += strf("- gpu-arena: %s, configure \"%s\"\n", g_ga.path.empty() ? "-" : g_ga.path.c_str(),
             opt.arena_conf.c_str());
  md += strf("- torch: %s (c10 caching allocator \"%s\", PYTORCH_CUDA_ALLOC_CONF=%s)\n", KV_TORCH_VERSION,
             run.torch_name.c_str(),
             std::getenv("PYTORCH_CUDA_ALLOC_CONF") ? std::getenv("PYTORCH_CUDA_ALLOC_CONF") : "unset");
  return md;
}

// The replay's section: the trace, the table, the details. A row that failed, or did not run
// for another reason than --skip, is a failure of the run.
std::string replay_markdown(Run& run, const std::vector<Row>& rows) {
  const Trace& trace = run.trace;
  bool& any_failure = run.any_failure;
  std::string md;
  md += strf("- trace: %s, seed %#" PRIx64 ", %" PRIu64 " requests: %" PRIu64 " ops, %" PRIu64
             " allocations, %" PRIu64 " streams (each allocator gets its own non-blocking streams), peak "
             "live %s (%" PRIu64 " B) in %" PRIu64 " allocations\n",
             trace.path.c_str(), trace.seed, trace.requests, trace.op_count, trace.allocs, trace.streams,
             fmt_bytes(static_cast<double>(trace.peak_live_bytes)).c_str(), trace.peak_live_bytes,
             trace.peak_live_allocs);
  md += strf("- process baseline free memory (primary context created, before any allocator): %s\n",
             fmt_bytes(static_cast<double>(run.baseline_free)).c_str());
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
  return md;
}

std::string pairs_markdown(const Options& opt, const std::vector<PairRow>& prow) {
  std::string md;
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
  return md;
}

std::string report(Run& run, const std::vector<Row>& rows, const std::string& interleaved_md,
                   const std::vector<PairRow>& prow, const std::vector<ScalingRow>& srow) {
  const Options& opt = run.opt;
  std::string md = report_header(run);
  if (!opt.no_replay) md += replay_markdown(run, rows);
  md += interleaved_md;
  if (!prow.empty()) md += pairs_markdown(opt, prow);
  if (!srow.empty())
    md += scaling_markdown(srow, std::min<uint64_t>(opt.warmup, opt.scaling_pairs), opt.pair_bytes);
  md += strf("\nResult: %s\n", run.any_failure ? "FAILURES (see the table and notes)" : "no failures");
  return md;
}

void write_report(const Options& opt, const std::string& md) {
  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  if (!opt.out.empty()) {
    FILE* f = std::fopen(opt.out.c_str(), "w");
    if (!f) die(strf("cannot write %s: %s", opt.out.c_str(), std::strerror(errno)));
    std::fputs(md.c_str(), f);
    std::fclose(f);
    logf("wrote %s", opt.out.c_str());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  Run run;
  run.opt = parse_args(argc, argv);
  open_device(run);
  read_trace(run);
  open_default_pool(run);
  open_gpu_arena(run);
  open_torch(run);
  std::vector<Row> rows;
  if (!run.opt.no_replay) rows = replay_phases(run);
  const std::string interleaved_md = interleaved_phase(run);
  std::vector<PairRow> prow;
  std::vector<ScalingRow> srow;
  if (!run.opt.no_pairs) pair_phases(run, prow, srow);
  const std::string md = report(run, rows, interleaved_md, prow, srow);
  write_report(run.opt, md);
  return run.any_failure ? 1 : 0;
}
