// kv_threads.h: kv_bench's thread part (helpers from kv_common.h, make_current from
// kv_adapters.h).
//
// - pair_bench: N threads, each on its own non-blocking stream, doing warm alloc/free pairs
//   through one allocator; a thread's loop time / its pairs, and all pairs / (last end -
//   first start) as the aggregate.
// - two workloads: `fixed` (alloc then free of one size, 2 MiB by default: the KV block) and
//   `mixed` (the thread keeps 8 allocations live and replaces one per pair, sizes cycling
//   through 512 B .. 16 MiB in an order that changes every window; the same workload as
//   gpu_arena_bench::threads on the sim backend).
// - scaling_bench / scaling_markdown: both workloads at T = 1, 2, 4, 8 (--scaling-threads)
//   for each allocator, with the aggregate's ratio to T = 1 (issue #14: >= 0.8 x T up to the
//   cores, >= 4x with 8 threads on the H200 host).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kv_adapters.h"
#include "kv_common.h"

namespace {

enum class Workload { Fixed, Mixed };

constexpr size_t kMixedSizes[8] = {512, 4u << 10, 24u << 10, 256u << 10, 1u << 20, 2u << 20, 6u << 20, 16u << 20};
constexpr uint64_t kMixedWindow = 8;

struct PairOut {
  bool ran = false;
  std::string why_not;
  int threads = 0;
  uint64_t pairs_per_thread = 0;
  double ns_per_pair_mean = 0, ns_per_pair_max = 0, pairs_per_s = 0;
  uint64_t failures = 0;
};

// One thread's workload state.
template <class Alloc, class Free>
struct ThreadWork {
  Workload w;
  size_t bytes;
  CUstream s;
  Alloc& al;
  Free& fr;
  void* live[kMixedWindow] = {};
  size_t live_bytes[kMixedWindow] = {};
  uint64_t step = 0, fails = 0;

  void pair() {
    if (w == Workload::Fixed) {
      void* p = al(bytes, s);
      if (p == nullptr) {
        ++fails;
        return;
      }
      if (!fr(p, bytes, s)) ++fails;
      return;
    }
    const uint64_t slot = step % kMixedWindow;
    if (live[slot] != nullptr) {
      if (!fr(live[slot], live_bytes[slot], s)) ++fails;
      live[slot] = nullptr;
    }
    const size_t b = kMixedSizes[(step * 3 + step / kMixedWindow) % 8];
    void* p = al(b, s);
    if (p == nullptr) ++fails;
    live[slot] = p;
    live_bytes[slot] = b;
    ++step;
  }

  void finish() {
    for (uint64_t i = 0; i < kMixedWindow; ++i) {
      if (live[i] != nullptr && !fr(live[i], live_bytes[i], s)) ++fails;
      live[i] = nullptr;
    }
  }
};

// `init` runs once on each thread before its warm-up (e.g. torch's current device).
template <class Init, class Alloc, class Free>
PairOut pair_bench(int nthreads, uint64_t pairs, uint64_t warmup, Workload w, size_t bytes,
                   const std::vector<CUstream>& streams, Init init, Alloc al, Free fr) {
  struct Res {
    Clock::time_point t0, t1;
    uint64_t fails = 0;
  };
  std::vector<Res> res(nthreads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> th;
  for (int i = 0; i < nthreads; ++i) {
    th.emplace_back([&, i] {
      make_current();
      init();
      ThreadWork<Alloc, Free> work{w, bytes, streams[i], al, fr};
      for (uint64_t k = 0; k < warmup; ++k) work.pair();
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      const Clock::time_point t0 = Clock::now();
      for (uint64_t k = 0; k < pairs; ++k) work.pair();
      const Clock::time_point t1 = Clock::now();
      work.finish();
      res[i] = Res{t0, t1, work.fails};
    });
  }
  while (ready.load() < nthreads) std::this_thread::yield();
  go.store(true, std::memory_order_release);
  for (auto& x : th) x.join();
  CU_CHECK(cuCtxSynchronize());
  PairOut o;
  o.ran = true;
  o.threads = nthreads;
  o.pairs_per_thread = pairs;
  Clock::time_point first = res[0].t0, last = res[0].t1;
  double sum = 0;
  for (const auto& r : res) {
    const double ns = secs(r.t1 - r.t0) * 1e9 / static_cast<double>(pairs ? pairs : 1);
    sum += ns;
    o.ns_per_pair_max = std::max(o.ns_per_pair_max, ns);
    first = std::min(first, r.t0);
    last = std::max(last, r.t1);
    o.failures += r.fails;
  }
  o.ns_per_pair_mean = sum / nthreads;
  const double wall = secs(last - first);
  o.pairs_per_s = wall > 0 ? static_cast<double>(pairs) * nthreads / wall : 0;
  return o;
}

template <class Init, class Alloc, class Free>
PairOut pair_bench(int nthreads, uint64_t pairs, uint64_t warmup, size_t bytes, const std::vector<CUstream>& streams,
                   Init init, Alloc al, Free fr) {
  return pair_bench(nthreads, pairs, warmup, Workload::Fixed, bytes, streams, init, al, fr);
}

struct ScalingPoint {
  int threads = 0;
  PairOut fixed, mixed;
};

// One allocator's scaling: both workloads at each thread count (fresh streams per run).
template <class MakeStreams, class Init, class Alloc, class Free>
std::vector<ScalingPoint> scaling_bench(const std::vector<int>& counts, uint64_t pairs, uint64_t warmup, size_t bytes,
                                        MakeStreams make_streams, Init init, Alloc al, Free fr) {
  std::vector<ScalingPoint> out;
  for (int t : counts) {
    ScalingPoint p;
    p.threads = t;
    p.fixed = pair_bench(t, pairs, warmup, Workload::Fixed, bytes, make_streams(t), init, al, fr);
    p.mixed = pair_bench(t, pairs, warmup, Workload::Mixed, bytes, make_streams(t), init, al, fr);
    logf("scaling: %d threads: fixed %.3g pairs/s (%.1f ns/pair/thread), mixed %.3g pairs/s (%.1f ns/pair/thread)",
         t, p.fixed.pairs_per_s, p.fixed.ns_per_pair_mean, p.mixed.pairs_per_s, p.mixed.ns_per_pair_mean);
    out.push_back(p);
  }
  return out;
}

struct ScalingRow {
  std::string name;
  std::string why_not;
  std::vector<ScalingPoint> points;
};

std::string scaling_markdown(const std::vector<ScalingRow>& rows, uint64_t warmup, size_t bytes) {
  std::string md;
  md += "\n## Thread scaling: T threads, each on its own non-blocking stream, one allocator\n\n";
  md += strf("Each thread runs its pairs (column) after %" PRIu64
             " warm-up pairs. `fixed`: alloc+free of %zu bytes; `mixed`: 8 live allocations per thread, one "
             "replaced per pair, sizes cycling through 512 B .. 16 MiB (freed with the size allocated). "
             "Aggregate = all pairs / (last end - first start); vs T=1 = aggregate / the 1-thread aggregate "
             "(target: >= 0.8 x T up to the cores, >= 4x at 8 threads).\n\n",
             warmup, bytes);
  md += "| allocator | workload | threads | pairs/thread | aggregate pairs/s | ns/pair/thread (mean) | max | vs T=1 | "
        "failures |\n";
  md += "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rows) {
    if (r.points.empty()) {
      md += strf("| %s | - | - | - | - | - | - | - | %s |\n", r.name.c_str(), r.why_not.c_str());
      continue;
    }
    for (int m = 0; m < 2; ++m) {
      const char* wname = m == 0 ? "fixed" : "mixed";
      double one = 0;
      for (const auto& p : r.points) {
        const PairOut& o = m == 0 ? p.fixed : p.mixed;
        if (p.threads == 1) one = o.pairs_per_s;
        const std::string ratio = one > 0 ? strf("%.2fx", o.pairs_per_s / one) : "-";
        md += strf("| %s | %s | %d | %" PRIu64 " | %.3g | %s | %s | %s | %" PRIu64 " |\n", r.name.c_str(), wname,
                   p.threads, o.pairs_per_thread, o.pairs_per_s, fmt_ns(o.ns_per_pair_mean).c_str(), fmt_ns(o.ns_per_pair_max).c_str(),
                   ratio.c_str(), o.failures);
      }
    }
  }
  return md;
}

}  // namespace
