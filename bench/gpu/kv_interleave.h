// kv_interleave.h: kv_bench's interleaved replay (--interleave N), gpu-arena against PyTorch.
//
// The sequential phases replay the trace on one allocator after the other; on the lent H200
// hosts the machine's speed changes within a second (the same process's 2 MiB pair ratio
// stays at 10-15x while its warm replay ratio swings from 6x to 13x), so one phase can run
// on a slow machine and the next on a fast one. Here both allocators replay the trace in one
// loop, alternating every N ops, each with its own pointers and streams, each chunk timed on
// its own: a change of speed that outlasts a chunk slows both alike. Which allocator goes
// first alternates from chunk to chunk, so each runs after the other's cache footprint
// equally often. Both hold their memory at once (the trace's peak live, twice).
//
// Uses kv_adapters.h (Trace, the adapters, make_streams, g_ga) and the sequential replay's
// ReplayOut (kv_replay.h); helpers from kv_common.h. Only built with torch.
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu_arena.h"
#include "kv_adapters.h"
#include "kv_common.h"
#include "kv_replay.h"

namespace {

struct InterleavedOut {
  bool ran = false;
  std::string why_not;  // when !ran
  size_t chunk = 0;
  ReplayOut ga_cold, ga_warm, torch_cold, torch_warm;
  bool failed = false;
  std::vector<std::string> notes;
};

// Replay ops [begin, end) of the trace on `a`; returns the allocations that failed.
template <class A>
uint64_t replay_span(A& a, const Op* ops, size_t begin, size_t end, std::vector<void*>& ptrs) {
  uint64_t fails = 0;
  for (size_t i = begin; i < end; ++i) {
    const Op& op = ops[i];
    if (op.kind == 0) {
      void* p = a.alloc(op.bytes, op.stream);
      if (p == nullptr) ++fails;
      ptrs[op.id] = p;
    } else if (void* p = ptrs[op.id]) {
      a.free(p, op.bytes, op.stream);
      ptrs[op.id] = nullptr;
    }
  }
  return fails;
}

// One replay of the trace by both allocators in lockstep, `chunk` ops at a time.
template <class A, class B>
void replay_lockstep(A& a, B& b, const Trace& t, size_t chunk, ReplayOut& oa, ReplayOut& ob) {
  std::vector<void*> pa(t.allocs, nullptr), pb(t.allocs, nullptr);
  const uint64_t fa0 = a.free_failures, fb0 = b.free_failures;
  const Op* ops = t.ops.data();
  const size_t n = t.ops.size();
  Clock::duration da{0}, db{0};
  for (size_t s = 0, k = 0; s < n; s += chunk, ++k) {
    const size_t e = std::min(n, s + chunk);
    auto run_a = [&] {
      const Clock::time_point t0 = Clock::now();
      oa.alloc_failures += replay_span(a, ops, s, e, pa);
      da += Clock::now() - t0;
    };
    auto run_b = [&] {
      const Clock::time_point t0 = Clock::now();
      ob.alloc_failures += replay_span(b, ops, s, e, pb);
      db += Clock::now() - t0;
    };
    if (k % 2 == 0) {
      run_a();
      run_b();
    } else {
      run_b();
      run_a();
    }
  }
  const Clock::time_point t1 = Clock::now();
  CU_CHECK(cuCtxSynchronize());
  oa.sync_s = ob.sync_s = secs(Clock::now() - t1);
  oa.loop_s = secs(da);
  ob.loop_s = secs(db);
  oa.ns_per_op = oa.loop_s * 1e9 / static_cast<double>(n ? n : 1);
  ob.ns_per_op = ob.loop_s * 1e9 / static_cast<double>(n ? n : 1);
  oa.free_failures = a.free_failures - fa0;
  ob.free_failures = b.free_failures - fb0;
}

// Both caches emptied (cold), a lockstep replay, another (warm), both caches emptied again.
InterleavedOut run_interleaved(const Trace& t, size_t nstreams, size_t chunk) {
  InterleavedOut out;
  out.chunk = chunk;
  GpuArenaAdapter a;
  TorchAdapter b;
  make_current();
  for (CUstream s : make_streams(nstreams)) a.streams.push_back(reinterpret_cast<void*>(s));
  for (CUstream s : make_streams(nstreams)) b.streams.push_back(reinterpret_cast<cudaStream_t>(s));
  auto empty_both = [&](const char* when) {
    if (g_ga.empty_cache(-1) != GPU_ARENA_OK) {
      out.failed = true;
      out.notes.push_back(strf("FAILURE: gpu_arena_empty_cache %s: %s", when, g_ga.last_error()));
    }
    tca::emptyCache();
    make_current();
  };
  empty_both("before");
  logf("interleaved: cold replay, every %zu ops", chunk);
  replay_lockstep(a, b, t, chunk, out.ga_cold, out.torch_cold);
  logf("interleaved: cold gpu-arena %.1f ns/op, PyTorch %.1f ns/op; warm replay", out.ga_cold.ns_per_op,
       out.torch_cold.ns_per_op);
  replay_lockstep(a, b, t, chunk, out.ga_warm, out.torch_warm);
  logf("interleaved: warm gpu-arena %.1f ns/op, PyTorch %.1f ns/op", out.ga_warm.ns_per_op,
       out.torch_warm.ns_per_op);
  empty_both("after");
  for (const ReplayOut* r : {&out.ga_cold, &out.ga_warm, &out.torch_cold, &out.torch_warm})
    if (r->alloc_failures || r->free_failures) out.failed = true;
  if (!g_torch_last_error.empty()) out.notes.push_back("last torch error: " + g_torch_last_error);
  out.ran = true;
  return out;
}

std::string interleaved_markdown(const InterleavedOut& il, const std::string& ga_label) {
  std::string md = strf("\n## Interleaved replay: gpu-arena and PyTorch alternating every %zu ops\n\n", il.chunk);
  if (!il.ran) return md + "Not run: " + il.why_not + "\n";
  md += "Both allocators replay the trace in one loop, taking turns every chunk of ops (which one goes first "
        "alternates), each with its own pointers and streams, each chunk timed on its own: a change of the "
        "machine's speed that outlasts a chunk slows both alike. Both hold their memory at once. Cold = both "
        "caches emptied first, warm = the same again.\n\n";
  md += "| allocator | cold ns/op | warm ns/op | failures |\n|---|---:|---:|---|\n";
  auto row = [&](const std::string& name, const ReplayOut& c, const ReplayOut& w) {
    const uint64_t f = c.alloc_failures + c.free_failures + w.alloc_failures + w.free_failures;
    md += strf("| %s | %s | %s | %" PRIu64 " |\n", name.c_str(), fmt_ns(c.ns_per_op).c_str(),
               fmt_ns(w.ns_per_op).c_str(), f);
  };
  row(ga_label, il.ga_cold, il.ga_warm);
  row("PyTorch CUDACachingAllocator", il.torch_cold, il.torch_warm);
  md += strf("| speedup (PyTorch / gpu-arena) | %.2fx | %.2fx | |\n",
             il.torch_cold.ns_per_op / il.ga_cold.ns_per_op, il.torch_warm.ns_per_op / il.ga_warm.ns_per_op);
  for (const auto& n : il.notes) md += "\n- " + n;
  return md + "\n";
}

}  // namespace
