// kv_replay.h: kv_bench's sequential replay: one allocator replays the whole trace (replay),
// and one allocator's phase of the run (run_phase: prepare, cold replay, warm replay, checks,
// teardown) as a table row (Row).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <string>
#include <vector>

#include "kv_adapters.h"
#include "kv_common.h"

namespace {

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

}  // namespace
