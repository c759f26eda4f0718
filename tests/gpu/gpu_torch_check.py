#!/usr/bin/env python3
"""Verify gpu-arena as PyTorch's CUDA allocator on a real GPU; print a markdown report.

Issue: "CUDA backend and the PyTorch pluggable allocator, verified on the H200".

Run it on the GPU machine from anywhere (it finds the repository from its own path):

    GPU_ARENA_LIB=/path/to/libgpu_arena.so OUT=/some/dir python3 tests/gpu/gpu_torch_check.py
    # or, with the staged build:  bash scripts/gpu-check.sh torch_check

The report is printed on stdout and written to ``$OUT/torch_report.md`` (raw numbers in
``$OUT/torch_report.json``) when OUT is set. The exit code is 1 when any check fails.
``--only transformer,pattern,streams,memory`` runs a subset. Progress goes to stderr.

Every check runs its GPU work in a fresh ``python`` subprocess (``torch_children.py``):
``gpu_arena.torch.install()`` must run before PyTorch initializes CUDA, and gpu-arena's init
is process-global. The parent process never imports torch. The children get PYTHONPATH =
``<repo>/python`` (+ the caller's), keep GPU_ARENA_LIB, and drop GPU_ARENA_BACKEND,
GPU_ARENA_CONF and PYTORCH_CUDA_ALLOC_CONF (so "default allocator" means torch's stock
caching allocator and gpu-arena runs on its cuda backend with the configuration given
here). CUBLAS_WORKSPACE_CONFIG=:4096:8 is set in every child (needed for deterministic
cuBLAS; set in all children so that they run the same kernels).

What each check asserts (all must hold for PASS):

1(i) transformer: nn.TransformerEncoder (d_model 512, 8 heads, 4 layers, ff 2048,
     dropout 0, pre-norm) + a Linear head, batch 16 x seq 256, bf16 autocast, MSE loss,
     AdamW, 50 steps, fully deterministic (seeded, use_deterministic_algorithms(True),
     math SDPA). Run once with torch's default allocator and once with gpu-arena installed:
     the 50 losses and every final parameter are bitwise equal (sha256 of the bytes); the
     gpu-arena run really used gpu-arena (cuda backend, allocations counted, every parameter
     inside a gpu-arena arena); the loss went down. On a mismatch the report gives the max
     abs difference per tensor and runs the default allocator a second time as a control.
1(ii) pattern: ~6000 uint8 tensors of 1 B .. 256 MiB (mostly odd sizes, log-uniform, plus
     edge sizes) on 4 streams (default + 3 side streams); each is allocated on its stream,
     filled on it with a per-tensor slice of a random 256 MiB reference, kept alive among up
     to 48 others (<= 3 GiB), then verified on the GPU against the reference (a quarter of
     them on another stream, with wait_stream + record_stream) and freed; addresses get
     reused. Asserts: 0 mismatched bytes, no two live tensors overlap (host check of
     [ptr, ptr+size) intervals), every pointer 256-byte aligned, addresses were reused,
     gpu_arena.validate() passes, and a self-test shows the checker catches a 1-byte flip.
2   streams: the cross-stream hazard. X (16 MiB) is allocated and filled (1.0) on the
     default stream; side stream A waits for it, sleeps ~50 ms (torch.cuda._sleep), then
     X += 1 and Y = X * 2 (expect 4) on A; X.record_stream(A); del X (freed while A still
     needs it); at once Z of the same size is allocated on stream B and filled with 7 on B.
     After a sync Y must be 4 and Z 7 everywhere. gpu-arena (default config) must pass all
     repetitions (how often Z got X's address is reported); with unsafe_ignore_streams=1 (stream
     rules off) at least one repetition must be corrupted with Z at X's address: that shows
     the test detects the bug. Also the same-stream case (X, sleep, Y, del X, Z all on one
     side stream): no corruption in either mode, and with the default config Z reuses X's
     address at once.
3   memory: in a process with gpu-arena installed, baseline free memory is read right after
     install() (torch.cuda.mem_get_info() is what initializes CUDA, so it cannot be read
     earlier in that process; it is taken before the first allocation). The workload
     (20 transformer steps + 1500 pattern tensors) runs twice; after each: del everything,
     gc.collect(), torch._C._cuda_clearCublasWorkspaces() (cuBLAS workspaces come from the
     allocator and torch keeps them), torch.cuda.empty_cache() (gpu-arena's reset hook),
     gpu_arena.empty_cache(). The same runs in a process with torch's default allocator
     (its first reading is the "pre-install" baseline). Asserts: (a) after the second run
     free memory is within 2 MiB of the free memory after the first run (every byte the
     workload took came back); (b) the memory not back after the first run (cold baseline -
     free) equals, within 2 MiB, what torch's own allocator leaves behind for the same
     workload: kernel images loaded lazily by CUDA and cuBLAS/cuBLASLt handles, which no
     allocator owns; (c) gpu-arena holds nothing afterwards (reserved 0, no live allocation,
     no arena, creates == destroys). The raw "free vs cold baseline" gap is reported.
4   stats: gpu_arena.stats() during/after the workload (reserved, peak reserved, arenas,
     backend creates/destroys...), shown next to torch's max_memory_reserved() of the
     default-allocator run. torch.cuda.max_memory_allocated() is not available with a
     pluggable allocator and is not called. Informational (part of check 3's process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_common import DROP_ENV, PYDIR, ROOT as REPO, child_env as checkout_env  # beside this file
from result_channel import NO_RESULT, run_reporting  # tests/python (gpu_common's path): a child's own channel

SCRIPT = Path(__file__).resolve()
CHILD = SCRIPT.with_name("torch_children.py")  # the workloads, one fresh process each

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CUBLAS_WS = ":4096:8"
TOL = 2 * MiB

# =======================================================================================
# Parent side: no torch here.
# =======================================================================================


def log(msg):
    print(f"[gpu_torch_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env():
    env = checkout_env()
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WS
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


RUNS = []  # (label, wall seconds, rc) of every child


def run_child(name, params, timeout, label=None):
    """Run one child; returns (result dict or None, error text or None)."""
    label = label or name
    cmd = [sys.executable, str(CHILD), name, json.dumps(params)]
    log(f"start {label} (timeout {timeout}s)")
    t0 = time.time()
    try:
        res, proc = run_reporting(cmd, env=child_env(), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        wall = time.time() - t0
        RUNS.append((label, wall, "timeout"))
        tail = (e.stderr or b"")
        tail = tail.decode("utf-8", "replace") if isinstance(tail, bytes) else tail
        return None, f"timed out after {timeout}s\n--- stderr tail ---\n{tail[-3000:]}"
    wall = time.time() - t0
    RUNS.append((label, wall, proc.returncode))
    log(f"done  {label}: rc={proc.returncode} in {wall:.1f}s")
    if res is NO_RESULT:
        return None, (f"exited {proc.returncode} without a result\n--- stdout tail ---\n"
                      f"{proc.stdout[-2000:]}\n--- stderr tail ---\n{proc.stderr[-4000:]}")
    if "child_error" in res:
        return None, res["child_error"] + f"\n--- stderr tail ---\n{proc.stderr[-3000:]}"
    return res, None


def mib(n):
    return f"{n / MiB:,.1f} MiB"


def fmt_bytes(n):
    if n is None:
        return "-"
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:,.1f} MiB"
    return f"{n:,} B"


class Check:
    def __init__(self, key, title):
        self.key, self.title = key, title
        self.asserts = []  # (ok, text)
        self.lines = []
        self.error = None
        self.raw = {}

    def expect(self, ok, text):
        self.asserts.append((bool(ok), text))
        return bool(ok)

    def add(self, line=""):
        self.lines.append(line)

    @property
    def passed(self):
        return self.error is None and bool(self.asserts) and all(ok for ok, _ in self.asserts)

    def markdown(self):
        out = [f"## {self.title}: {'PASS' if self.passed else 'FAIL'}", ""]
        if self.error:
            out += ["**Error:**", "", "```", self.error.strip()[-6000:], "```", ""]
        if self.asserts:
            out += ["Assertions:", ""]
            out += [f"- {'✅' if ok else '❌'} {text}" for ok, text in self.asserts]
            out.append("")
        out += self.lines
        out.append("")
        return "\n".join(out)


INFO = {}


def check_transformer(tmp):
    c = Check("transformer", "1(i) Same results as torch's default allocator: transformer training")
    steps = 50
    ref_file, got_file = str(tmp / "ref.pt"), str(tmp / "got.pt")
    ref, err = run_child("transformer", {"mode": "default", "steps": steps, "save": ref_file},
                         240, "transformer/default")
    if err:
        c.error = "default-allocator run: " + err
        return c
    INFO.setdefault("default", ref["info"])
    got, err = run_child("transformer", {"mode": "arena", "conf": None, "steps": steps,
                                         "save": got_file}, 240, "transformer/gpu-arena")
    if err:
        c.error = "gpu-arena run: " + err
        return c
    INFO.setdefault("arena", got["info"])
    c.raw = {"default": ref, "arena": got}
    st = got["stats"]
    c.expect(got["info"].get("gpu_arena_backend") == "cuda",
             f"gpu-arena ran on its cuda backend (`{got['info'].get('gpu_arena_backend')}`)")
    c.expect(st["alloc_count"] > 0,
             f"the training allocated through gpu-arena ({st['alloc_count']:,} allocations)")
    c.expect(got["params_in_arenas"] == got["params_total"],
             f"every parameter lies inside a gpu-arena arena ({got['params_in_arenas']}/{got['params_total']})")
    lr, lg = ref["losses"], got["losses"]
    n_loss_diff = sum(a != b for a, b in zip(lr, lg)) + abs(len(lr) - len(lg))
    max_loss_diff = max((abs(a - b) for a, b in zip(lr, lg)), default=0.0)
    c.expect(len(lr) == steps and n_loss_diff == 0,
             f"the {steps} losses are bitwise equal ({n_loss_diff} differ, max |diff| {max_loss_diff:.3g})")
    dr, dg = ref["digests"], got["digests"]
    diff_keys = sorted(k for k in dr if dr.get(k) != dg.get(k)) + sorted(set(dg) - set(dr))
    c.expect(not diff_keys,
             f"all {len(dr)} final parameter tensors ({ref['n_params']:,} values) are bitwise equal "
             f"(sha256; {len(diff_keys)} differ)")
    c.expect(lr[-1] < lr[0], f"training made progress (loss {lr[0]:.5f} -> {lr[-1]:.5f})")

    c.add("Setup: nn.TransformerEncoder(d_model=512, nhead=8, num_layers=4, dim_feedforward=2048, "
          "dropout=0, batch_first, norm_first) + Linear(512, 512); batch 16 x seq 256; "
          "torch.autocast(bfloat16) over fp32 parameters; MSE loss; AdamW(lr=3e-4, wd=0.01, foreach); "
          f"torch.manual_seed(0), use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG={CUBLAS_WS}, "
          f"SDPA backend: {got['sdpa']}. gpu-arena config: default (arena_size 1 GiB).")
    c.add("")
    c.add("| | default allocator | gpu-arena |")
    c.add("|---|---|---|")
    c.add(f"| training wall time ({steps} steps, incl. first-use warm-up) | {ref['train_s']:.2f} s | {got['train_s']:.2f} s |")
    for i in (0, 1, 9, 24, steps - 1):
        if i < len(lr) and i < len(lg):
            c.add(f"| loss step {i + 1} | `{lr[i]!r}` | `{lg[i]!r}` |")
    c.add(f"| parameters digest (sha256 of all) | `{hashlib.sha256(json.dumps(dr, sort_keys=True).encode()).hexdigest()[:16]}` "
          f"| `{hashlib.sha256(json.dumps(dg, sort_keys=True).encode()).hexdigest()[:16]}` |")
    c.add(f"| gpu-arena allocations / frees / peak reserved | - | {st['alloc_count']:,} / {st['free_count']:,} / "
          f"{fmt_bytes(st['peak_reserved_bytes'])} |")

    if n_loss_diff or diff_keys:
        cmp_res, err = run_child("compare", {"a": ref_file, "b": got_file}, 120, "compare")
        if err:
            c.add(f"\nCould not compare the parameter files: {err[-1500:]}")
        else:
            worst = sorted(cmp_res.items(), key=lambda kv: -kv[1].get("max_abs_diff", 0))[:10]
            overall = max((v.get("max_abs_diff", 0) for v in cmp_res.values()), default=0)
            c.add(f"\nMax abs difference over all parameters: **{overall:.3g}**. Worst tensors:\n")
            c.add("| tensor | max abs diff | elements differing |")
            c.add("|---|---|---|")
            for k, v in worst:
                c.add(f"| `{k}` | {v.get('max_abs_diff', 0):.3g} | {v.get('n_diff', '?')}/{v.get('numel', '?')} |")
        ctl, err = run_child("transformer", {"mode": "default", "steps": steps,
                                             "save": str(tmp / "ctl.pt")}, 240, "transformer/control")
        if err:
            c.add(f"\nControl run failed: {err[-1500:]}")
        else:
            same = ctl["losses"] == lr and ctl["digests"] == dr
            c.add("\nControl (a second default-allocator process): "
                  + ("bitwise equal to the first: the setup is deterministic, so the difference "
                     "comes with gpu-arena." if same else
                     "NOT equal to the first default run either: the workload itself is not "
                     "deterministic across processes on this stack; the gpu-arena difference "
                     "may not be the allocator's."))
    return c


def check_pattern():
    c = Check("pattern", "1(ii) Write/read pattern over many sizes and streams")
    p = {"n": 6000, "live_max": 48, "live_bytes_max": 3 * GiB, "seed": 12345, "conf": None}
    r, err = run_child("pattern", p, 240, "pattern/gpu-arena")
    if err:
        c.error = err
        return c
    INFO.setdefault("arena", r["info"])
    c.raw = r
    c.expect(r["selftest_detected"] == 1,
             f"self-test: a 1-byte flip is detected ({r['selftest_detected']} byte counted, expected 1)")
    c.expect(r["mismatched_bytes"] == 0,
             f"every tensor read back equal to its pattern ({r['mismatched_bytes']:,} mismatched bytes)")
    c.expect(r["overlaps"] == 0, f"no two live tensors overlap ({r['overlaps']} overlaps"
             + (f", e.g. {r['overlap_examples']}" if r["overlaps"] else "") + ")")
    c.expect(r["misaligned_256"] == 0, f"every pointer is 256-byte aligned ({r['misaligned_256']} not)")
    c.expect(r["reused"] > 0, f"freed memory was reused ({r['reused']:,} allocations at an address seen before)")
    c.expect(r["validate"] == "ok", f"gpu_arena.validate() after the run: {r['validate']}")
    st = r["stats"]
    c.add("| | |")
    c.add("|---|---|")
    c.add(f"| tensors (allocate on stream s, fill on s, verify, free) | {r['tensors']:,} |")
    c.add(f"| streams | {r['streams']} (the default stream + {r['streams'] - 1} side streams) |")
    c.add(f"| sizes | {r['min_size']:,} B .. {fmt_bytes(r['max_size'])}; {r['odd_sizes']:,} odd; "
          f"{r['over_64MiB']} above 64 MiB; edges 1, 511-513, 2 MiB +/- 1, 64 MiB +/- 1, 256 MiB |")
    c.add(f"| bytes written and verified | {fmt_bytes(r['bytes_written'])} |")
    c.add(f"| live at once | up to {p['live_max']} tensors / {fmt_bytes(p['live_bytes_max'])} |")
    c.add(f"| verified on another stream (wait_stream + record_stream) | {r['cross_stream_verifies']:,} |")
    c.add(f"| distinct addresses / reuses | {r['distinct_addresses']:,} / {r['reused']:,} |")
    c.add(f"| pointers not 512-aligned (info) | {r['not_512_aligned']} |")
    c.add(f"| gpu-arena: allocations / frees / peak reserved / arenas now / creates / destroys | "
          f"{st['alloc_count']:,} / {st['free_count']:,} / {fmt_bytes(st['peak_reserved_bytes'])} / "
          f"{st['arenas']} / {st['backend_creates']} / {st['backend_destroys']} |")
    c.add(f"| wall time | {r['wall_s']:.1f} s |")
    return c


def check_streams(reps):
    c = Check("streams", "2 Cross-stream safety (record_stream) and same-stream reuse")
    p = {"numel": 4 * MiB, "reps": reps, "cycles": 100_000_000}
    safe, err = run_child("streams", dict(p, conf=None), 180, "streams/gpu-arena")
    if err:
        c.error = "gpu-arena (default config): " + err
        return c
    INFO.setdefault("arena", safe["info"])
    unsafe, err = run_child("streams", dict(p, conf="unsafe_ignore_streams=1"), 180,
                            "streams/unsafe_ignore_streams=1")
    if err:
        c.error = "gpu-arena with unsafe_ignore_streams=1: " + err
        return c
    c.raw = {"safe": safe, "unsafe": unsafe}
    sc, uc, ss, us = safe["cross"], unsafe["cross"], safe["same"], unsafe["same"]
    c.expect(sc["corrupt_reps"] == 0,
             f"gpu-arena: cross-stream case uncorrupted in every repetition ({sc['corrupt_reps']}/{sc['reps']} corrupted)")
    c.expect(uc["corrupt_at_same_address"] >= 1,
             f"unsafe_ignore_streams=1: the test detects the race: {uc['corrupt_reps']}/{uc['reps']} repetitions "
             f"corrupted, {uc['corrupt_at_same_address']} of them with Z at X's address")
    c.expect(ss["corrupt_reps"] == 0 and us["corrupt_reps"] == 0,
             f"same stream: no corruption (gpu-arena {ss['corrupt_reps']}/{ss['reps']}, "
             f"unsafe {us['corrupt_reps']}/{us['reps']})")
    c.expect(ss["same_address"] >= 1,
             f"same stream: X's block is reused at once by Z on its own stream ({ss['same_address']}/{ss['reps']} repetitions)")
    c.expect(safe["validate"] == "ok", f"gpu_arena.validate() after the run: {safe['validate']}")

    c.add(f"Per repetition: X = {p['numel'] * 4 // MiB} MiB float32 of 1.0 allocated and filled on the default "
          f"stream; side stream A waits for it, runs a long kernel ({safe['long_kernel']}, "
          f"{safe['sleep_ms']:.1f} ms measured), then `X.add_(1)` and `Y = X * 2` (expect 4.0); "
          "`X.record_stream(A)`; `del X` (freed on the default stream while A still needs it); at once "
          "`Z = torch.empty(same size)` and `Z.fill_(7.0)` on stream B; `torch.cuda.synchronize()`; "
          "Y must be 4.0 and Z 7.0 everywhere. If X's memory were handed to Z before A finished, B's fill "
          "lands first and A computes 2 * (7 + 1) = 16 and leaves 8 in Z.")
    c.add("")
    c.add("| case | config | reps | Z at X's address | corrupted reps (Y / Z) |")
    c.add("|---|---|---|---|---|")
    c.add(f"| cross-stream | default | {sc['reps']} | {sc['same_address']} | {sc['corrupt_reps']} "
          f"({sc['y_corrupt']} / {sc['z_corrupt']}) |")
    c.add(f"| cross-stream | unsafe_ignore_streams=1 | {uc['reps']} | {uc['same_address']} | {uc['corrupt_reps']} "
          f"({uc['y_corrupt']} / {uc['z_corrupt']}) |")
    c.add(f"| same stream | default | {ss['reps']} | {ss['same_address']} | {ss['corrupt_reps']} |")
    c.add(f"| same stream | unsafe_ignore_streams=1 | {us['reps']} | {us['same_address']} | {us['corrupt_reps']} |")
    c.add("")
    c.add(f"Host time of Z's allocation on B, max over reps: {sc['max_z_alloc_ms']:.3f} ms with the default "
          f"config (gpu-arena does not wait for A: it hands out other memory), {uc['max_z_alloc_ms']:.3f} ms unsafe. "
          f"gpu-arena after the default-config run: pending_free_bytes {fmt_bytes(safe['stats']['pending_free_bytes'])}.")
    if uc["examples"]:
        c.add("")
        c.add("Corruption shown with unsafe_ignore_streams=1 (first examples):")
        c.add("")
        c.add("| rep | X address | Z address | Y values (expect 4.0) | Y bad elems | Z values (expect 7.0) | Z bad elems |")
        c.add("|---|---|---|---|---|---|---|")
        for e in uc["examples"]:
            c.add(f"| {e['rep']} | `{e['x_ptr']}` | `{e['z_ptr']}` | {e['y_values']} | {e['y_bad_elems']:,}/{e['numel']:,} "
                  f"| {e['z_values']} | {e['z_bad_elems']:,}/{e['numel']:,} |")
    for name, cc in (("default config, cross-stream", sc), ("default config, same stream", ss),
                     ("unsafe, same stream", us)):
        if cc["examples"]:
            c.add(f"\nUnexpected corruption ({name}): `{json.dumps(cc['examples'])}`")
    return c


def check_memory():
    c3 = Check("memory", "3 empty_cache gives the memory back")
    c4 = Check("stats", "4 gpu_arena.stats() around the workload")
    p = {"steps": 20, "n": 1500}
    dflt, err = run_child("memory", dict(p, mode="default"), 240, "memory/default")
    if err:
        c3.error = c4.error = "default-allocator run: " + err
        return c3, c4
    arena, err = run_child("memory", dict(p, mode="arena", conf=None), 240, "memory/gpu-arena")
    if err:
        c3.error = c4.error = "gpu-arena run: " + err
        return c3, c4
    INFO.setdefault("arena", arena["info"])
    c3.raw = c4.raw = {"default": dflt, "arena": arena}
    a1, a2 = arena["runs"]
    d1, d2 = dflt["runs"]
    base_a, base_d = arena["base_free"], dflt["base_free"]
    steady = a1["free_after"] - a2["free_after"]
    cold_a, cold_d = base_a - a1["free_after"], base_d - d1["free_after"]
    raw_gap = base_a - a2["free_after"]
    st = a2["stats_after"]
    c3.expect(arena["has_clearCublasWorkspaces"],
              "torch._C._cuda_clearCublasWorkspaces exists (called before empty_cache)")
    c3.expect(abs(steady) <= TOL,
              f"(a) after the 2nd workload run free memory is within 2 MiB of the free memory after the 1st "
              f"(difference {steady / MiB:+.2f} MiB)")
    c3.expect(abs(cold_a - cold_d) <= TOL,
              f"(b) what is not back after the 1st run (baseline right after install() - free) equals what torch's "
              f"default allocator leaves for the same workload: {cold_a / MiB:.1f} MiB vs {cold_d / MiB:.1f} MiB "
              f"(difference {(cold_a - cold_d) / MiB:+.2f} MiB): it is CUDA's lazily loaded kernels and library "
              "handles, not allocator memory")
    c3.expect(st["reserved_bytes"] == 0 and st["allocations"] == 0 and st["arenas"] == 0,
              f"(c) gpu-arena holds nothing afterwards: reserved {fmt_bytes(st['reserved_bytes'])}, "
              f"{st['allocations']} live allocations, {st['arenas']} arenas"
              + (f", used ranges left: {a2['used_ranges_after'][:10]}" if a2["used_ranges_after"] else ""))
    c3.expect(st["backend_creates"] == st["backend_destroys"],
              f"(c) every arena created was destroyed ({st['backend_creates']} creates, {st['backend_destroys']} destroys)")
    c3.expect(arena.get("validate") == "ok", f"gpu_arena.validate(): {arena.get('validate')}")

    c3.add("Baseline: in the gpu-arena process `install()` comes first and `torch.cuda.mem_get_info()` is what "
           "initializes CUDA (it calls gpu-arena's init hook), so the baseline is read right after install(), "
           "before the first allocation. The default-allocator process reads its baseline the same way "
           "(pre-install reference). Workload, run twice per process: 20 steps of the check-1(i) transformer "
           "+ 1500 pattern tensors (1 B .. 256 MiB, 4 streams). Cleanup after each: del, gc.collect(), "
           "torch._C._cuda_clearCublasWorkspaces(), torch.cuda.empty_cache(), gpu_arena.empty_cache().")
    c3.add("")
    c3.add("| free device memory | default allocator | gpu-arena |")
    c3.add("|---|---|---|")
    c3.add(f"| baseline (CUDA just initialized, nothing allocated) | {mib(base_d)} | {mib(base_a)} |")
    c3.add(f"| after run 1 + cleanup | {mib(d1['free_after'])} | {mib(a1['free_after'])} |")
    c3.add(f"| after run 2 + cleanup | {mib(d2['free_after'])} | {mib(a2['free_after'])} |")
    c3.add(f"| allocator's reserved memory after cleanup (run 2) | "
           f"{fmt_bytes(d2['torch_memory_reserved_after'])} (torch.cuda.memory_reserved) | "
           f"{fmt_bytes(a2['stats_after']['reserved_bytes'])} (gpu_arena.stats) |")
    c3.add(f"| baseline - after run 1 (cold: kernels/handles loaded on first use) | {mib(cold_d)} | {mib(cold_a)} |")
    c3.add(f"| after run 1 - after run 2 (steady state) | {mib(d1['free_after'] - d2['free_after'])} | {mib(steady)} |")
    c3.add("")
    c3.add(f"Raw gap between gpu-arena's baseline right after install() and the end: {raw_gap / MiB:.1f} MiB "
           f"({'within' if abs(raw_gap) <= TOL else 'NOT within'} 2 MiB). "
           + ("As (b) shows, torch's own allocator leaves the same amount: CUDA loads kernel images on first "
              "use (CUDA_MODULE_LOADING="
              f"{arena['info'].get('CUDA_MODULE_LOADING')}) and cuBLAS/cuBLASLt keep their handles; none of it "
              "is allocator memory, so the baseline to compare with is the one after a first run (a)."
              if abs(raw_gap) > TOL else ""))
    c3.add(f"gpu-arena's own init cost (default baseline - gpu-arena baseline, separate processes): "
           f"{(base_d - base_a) / MiB:+.1f} MiB. After torch.cuda.empty_cache() alone (reset hook), "
           f"gpu-arena reserved {fmt_bytes(a2['stats_after_torch_empty_cache']['reserved_bytes'])}.")

    # ---- check 4: stats
    c4.expect(True, "informational (gpu-arena's counters as the workload sees them)")
    keys = ["reserved_bytes", "allocated_bytes", "peak_reserved_bytes", "peak_allocated_bytes", "arenas",
            "backend_creates", "backend_destroys", "allocations", "alloc_count", "free_count", "oom_count",
            "pending_free_bytes", "deferred_free_bytes"]
    cols = [("run 1: after training (model live)", a1["probes"].get("after_training (model live)")),
            ("run 2: after training (model live)", a2["probes"].get("after_training (model live)")),
            ("run 2: after pattern", a2["probes"].get("after_pattern")),
            ("run 2: after torch.cuda.empty_cache()", a2["stats_after_torch_empty_cache"]),
            ("run 2: after gpu_arena.empty_cache()", a2["stats_after"])]
    c4.add("| counter | " + " | ".join(n for n, _ in cols) + " |")
    c4.add("|---|" + "---|" * len(cols))
    for k in keys:
        vals = []
        for _, s in cols:
            v = (s or {}).get(k)
            vals.append(fmt_bytes(v) if k.endswith("_bytes") and v is not None else (f"{v:,}" if v is not None else "-"))
        c4.add(f"| {k} | " + " | ".join(vals) + " |")
    c4.add("")
    c4.add(f"For comparison, torch's default allocator on the same workload: "
           f"torch.cuda.max_memory_reserved() = {fmt_bytes(d2['torch_max_memory_reserved'])} "
           f"(gpu-arena peak_reserved_bytes = {fmt_bytes(a2['stats_after']['peak_reserved_bytes'])}). "
           "torch.cuda.max_memory_allocated() / memory_stats() do not work with a pluggable allocator: "
           "not called; gpu_arena.stats() is the source.")
    return c3, c4


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="transformer,pattern,streams,memory",
                    help="comma-separated subset of: transformer,pattern,streams,memory")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of each stream case (default 20)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for torch_report.md (default $OUT)")
    args = ap.parse_args(argv)

    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {"transformer", "pattern", "streams", "memory"}
    if unknown:
        ap.error(f"unknown check(s): {', '.join(sorted(unknown))}")
    t_start = time.time()
    checks = []
    with tempfile.TemporaryDirectory(prefix="gpu_torch_check_") as tmp:
        tmp = Path(tmp)
        for key, fn in (("transformer", lambda: [check_transformer(tmp)]),
                        ("pattern", lambda: [check_pattern()]),
                        ("streams", lambda: [check_streams(args.reps)]),
                        ("memory", lambda: list(check_memory()))):
            if key not in only:
                continue
            try:
                checks += fn()
            except Exception:  # noqa: BLE001 - a bug here must still give a report
                c = Check(key, f"{key} (check crashed)")
                c.error = traceback.format_exc()
                checks.append(c)
    total = time.time() - t_start

    info = INFO.get("arena") or INFO.get("default") or {}
    lines = ["# gpu-arena as PyTorch's CUDA allocator: verification report", ""]
    lines.append(f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}; host: {platform.node()}")
    lines.append(f"- GPU: {info.get('gpu', '?')} ({fmt_bytes(info.get('gpu_total_bytes'))}); torch "
                 f"{info.get('torch', '?')} (CUDA {info.get('cuda', '?')}); python {info.get('python', platform.python_version())}")
    lines.append(f"- gpu-arena library: `{info.get('gpu_arena_lib', os.environ.get('GPU_ARENA_LIB', '?'))}` "
                 f"(GPU_ARENA_LIB={'set' if os.environ.get('GPU_ARENA_LIB') else 'not set'}), "
                 f"backend `{info.get('gpu_arena_backend', '?')}`")
    lines.append(f"- command: `{' '.join([Path(sys.executable).name, str(SCRIPT.relative_to(REPO)) if SCRIPT.is_relative_to(REPO) else str(SCRIPT)] + (argv if argv is not None else sys.argv[1:]))}`; "
                 f"children: fresh interpreters, PYTHONPATH={PYDIR}, CUBLAS_WORKSPACE_CONFIG={CUBLAS_WS}, "
                 f"dropped {', '.join(DROP_ENV)}")
    lines.append(f"- total wall time: {total:.1f} s")
    lines.append("")
    lines.append("| check | result |")
    lines.append("|---|---|")
    for c in checks:
        n_ok = sum(ok for ok, _ in c.asserts)
        lines.append(f"| {c.title} | {'PASS' if c.passed else 'FAIL'} ({n_ok}/{len(c.asserts)} assertions"
                     + (", error" if c.error else "") + ") |")
    lines.append("")
    for c in checks:
        lines.append(c.markdown())
    lines.append("## Subprocesses")
    lines.append("")
    lines.append("| run | wall | exit |")
    lines.append("|---|---|---|")
    for label, wall, rc in RUNS:
        lines.append(f"| {label} | {wall:.1f} s | {rc} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "torch_report.md").write_text(report)
        (out / "torch_report.json").write_text(json.dumps(
            {"info": INFO, "checks": {c.key: {"passed": c.passed, "asserts": c.asserts,
                                              "error": c.error, "raw": c.raw} for c in checks},
             "runs": RUNS, "total_s": total}, indent=1, default=str))
        log(f"report written to {out / 'torch_report.md'}")
    failed = [c.key for c in checks if not c.passed]
    log("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
