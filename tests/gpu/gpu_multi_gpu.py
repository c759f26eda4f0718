#!/usr/bin/env python3
"""Every multi-GPU check of issue #27, on however many GPUs the host has, in one call.

    OUT=DIR python3 tests/gpu/gpu_multi_gpu.py [--only pools,import,ddp,tp,nixl,seed] [--quick]

The short table (check | result | key figures) is printed last; the full report goes to
$OUT/multi_gpu.md, the raw figures to $OUT/multi_gpu.json, every child's full log to
$OUT/multi_gpu_logs/ ($OUT: gpu-out when unset). Exit 1 only when a check that ran failed; a
check or part that could not run says "not run" and why (NIXL not installed, "needs 2+ GPUs",
out of time). GPU_ARENA_LIB defaults to the staged .gpu/libgpu_arena.so when that exists, and
NIXL to the staged wheel .gpu/wheels/nixl_cu13-*.whl (installed into /tmp/nixl-site, as
scripts/gpu-nixl.sh does) when no nixl module is importable.

On ONE GPU it is a dry run: every pair-based part runs on the pair (0, 0) (same device on both
sides: copies within GPU 0, two processes on GPU 0), DDP and tensor parallelism with world size
1, and the parts that need two devices say "needs 2+ GPUs: not run". `--quick` (smaller sizes,
3 seed cycles) validates the script on one GPU in about 4 minutes. The full run on 8 H200s is
sized for one call of 600 s (--budget-s 580 stops starting checks past it); if a call runs out,
run it as two: `--only pools,import,ddp,tp` then `--only nixl,seed`.

GPU work runs in fresh interpreters (multi_gpu_children.py, multi_gpu_dist.py,
multi_gpu_nixl.py), each group with a timeout (its process groups SIGKILLed past it, or 20 s
after one failed), results in a file per child, never on stdout/stderr (NCCL, NIXL and torch
write there); the parent never imports torch. A first child (prep) builds the native allocator
and the NIXL plugin once and reads the machine.

What each check asserts (all must hold for PASS; tol = --tol-mib, 4 MiB by default):

pools   One process, gpu_arena.torch.install() (route native), GPUs used one after the other
        (tensors on cuda:0 before cuda:1 is touched, ...): every tensor in a gpu-arena arena of
        its own device. Every ordered pair (i, j): a memcpy copy_, a copy kernel on GPU i writing
        GPU j's memory (dtype change), a kernel on GPU j writing into GPU i's arena made before
        GPU j was first used (strided copy), 1 GiB copies: every byte verified where it landed.
        Bandwidth per pair, three ways in one loop: torch copy_ on gpu-arena memory, then
        cudaMemcpyPeer (ctypes, the libcudart torch loaded) on the same buffers and on cudaMalloc
        buffers: median copy_ / cudaMemcpyPeer(cudaMalloc) >= 0.9. At scale: half of each GPU's
        free memory in 1 GiB tensors, verified, freed: reserved back, free memory within tol on
        every GPU; validate() per device. PyTorch's allocator runs the same (control, beside).
import  A producer process per GPU i shares one tensor per consumer (gpu_arena.share); a
        consumer per GPU j opens every producer's (gpu_arena.open: mapped on GPU i), copies it
        into GPU j's memory and runs a kernel over it (bytes verified), writes into it (a copy
        and a strided kernel from GPU j); the producer sees both writes and the rest intact.
        Every (i, j) both ways (and i == j). Then imports closed (imports_live 0), the producer
        unshares, frees and empties: reserved 0, exports 0, and GPU i's free memory within tol
        of its baseline while every consumer is alive.
ddp     One process per GPU (world size = GPU count, NCCL, NCCL_NVLS_ENABLE=0 in every rank),
        DistributedDataParallel on a deterministic transformer (bf16 autocast, AdamW, math
        SDPA, use_deterministic_algorithms) with gpu-arena in every rank, then with PyTorch's
        allocator: every rank's losses, the all-reduced losses and the final parameters bitwise
        equal between the two (and the parameters equal across ranks); an all_reduce sum is
        exact; all_reduce time per op at >= 64 MiB within noise of PyTorch's (at most
        max(10%, the two runs' round-to-round spread) slower). A mismatch triggers a second
        PyTorch run, reported as the control.
tp      One process per GPU under gpu-arena: a decode loop with weights sharded over every GPU
        (column/row-parallel attention and MLP, tag `weights`), a KV cache per GPU (tag
        `kv_cache`), one decode step captured as a CUDA graph with its all_reduces inside
        (--tp-graph full; if that capture fails everywhere the check reruns with piecewise
        graphs and eager all_reduces between them, and says so). Graph output close to eager
        and identical on every rank; then every rank sleeps at once (weights offloaded, KV
        discarded: >= 90% of their bytes back to the driver on each GPU) and wakes: same
        addresses, weights bitwise equal, the graph's replay bitwise equal to before, free
        memory within tol of before the sleep once sleep's kept host buffers are released
        (gpu_arena.sleep_release_host: their registration holds device memory, about 2 MiB
        per GiB; the figure while they are kept is reported beside).
nixl    NIXL's GPU_ARENA backend between GPU pairs: a prefill process per GPU i and a decode
        process per GPU j, round k pairing i -> (i + k) % N, so every ordered pair is covered
        in N-1 rounds (the pair (0, 0) on one GPU). Each round: 8 x 1.5 GiB KV, 2 MiB blocks
        and two whole layers READ and verified; READ bandwidth beside the same-run device
        copy and peer copy (GPU i -> GPU j, the decode process's own buffers): median layer
        READ >= 0.5x the peer copy; the prefill deregisters (revocation): the decode's
        mappings are gone (imports_live 0) and a READ is refused; memory back on both GPUs
        (prefill: GPU i, decode: GPU j) within tol with both processes alive; one export per
        arena.
seed    The seed flow across GPUs: the same roles with 32 x 1.5 GiB KV per producer and 10
        in-process shutdowns (the pairing rotates over the other GPUs): every cycle verified,
        revoked, and every GPU's free memory within tol of its baseline with both processes
        alive.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_common import ROOT, child_env, free_port, out_path  # beside this file

SCRIPT = Path(__file__).resolve()
CHILD = SCRIPT.with_name("multi_gpu_children.py")
CHECKS = ("pools", "import", "ddp", "tp", "nixl", "seed")
MiB, GiB = 1 << 20, 1 << 30
T_START = time.time()


def log(msg):
    print(f"[gpu_multi_gpu +{time.time() - T_START:5.0f}s] {msg}", file=sys.stderr, flush=True)


def fmt_bytes(n):
    return "-" if n is None else f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def med(xs):
    return statistics.median(xs) if xs else float("nan")


# ---- running children ----------------------------------------------------------------


class Runner:
    """Groups of children: each child in a session of its own (its group SIGKILLed at the
    end: leftovers, or all of it past the timeout), stdout+stderr to its log, result from a
    file. One failed child (exit or child_error) ends its group 20 s later."""

    def __init__(self, out: Path, tmp: Path, env: dict, deadline: float):
        self.logs = out / "multi_gpu_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tmp, self.env, self.deadline = tmp, env, deadline
        self.runs = []  # [tag, wall s, exit]

    def left(self):
        return self.deadline - time.time()

    def start(self, label, procs, work=None):
        """procs: [(sub, child name, params, extra env)]."""
        group = {"label": label, "work": work, "procs": []}
        for sub, name, params, extra in procs:
            tag = f"{label}-{sub}" if sub else label
            res = self.tmp / f"{tag}.json"
            res.unlink(missing_ok=True)
            logf = open(self.logs / f"{tag}.log", "w")
            cmd = [sys.executable, str(CHILD), name, str(res), json.dumps(params)]
            proc = subprocess.Popen(cmd, env={**self.env, **(extra or {})}, stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
            group["procs"].append({"sub": sub, "tag": tag, "proc": proc, "res": res, "logf": logf, "t0": time.time()})
        log(f"start {label}: {len(procs)} process(es)")
        return group

    @staticmethod
    def _failed(g):
        try:
            return "child_error" in json.loads(g["res"].read_text())
        except (OSError, ValueError):
            return True

    def wait(self, group, timeout, grace=20):
        """{sub: (result, None) or (None, error text)}."""
        end = min(time.time() + timeout, self.deadline)
        pending, fail_at = list(group["procs"]), None
        while pending and time.time() < end and not (fail_at and time.time() > fail_at + grace):
            for g in list(pending):
                if os.waitid(os.P_PID, g["proc"].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    pending.remove(g)
                    if fail_at is None and self._failed(g):
                        fail_at = time.time()
                        if group["work"]:  # its peers stop waiting for it
                            Path(group["work"], "abort").write_text(json.dumps({"who": g["tag"], "error": "exited"}))
            time.sleep(0.1)
        why = "timeout" if time.time() >= end else "a peer failed"
        out = {}
        for g in group["procs"]:
            try:  # not reaped yet: the group id is still this child's
                os.killpg(g["proc"].pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            rc = g["proc"].wait()
            g["logf"].close()
            if g in pending:
                rc = f"killed: {why}"
            wall = round(time.time() - g["t0"], 1)
            self.runs.append([g["tag"], wall, rc])
            tail = (self.logs / f"{g['tag']}.log").read_text(errors="replace")[-2500:]
            try:
                res = json.loads(g["res"].read_text())
            except (OSError, ValueError):
                res = None
            if res is None:
                out[g["sub"]] = (None, f"{g['tag']}: exit {rc} without a result\n--- log tail ---\n{tail}")
            elif "child_error" in res:
                out[g["sub"]] = (None, f"{g['tag']}: {res['child_error'][-3000:]}\n--- log tail ---\n{tail[-1200:]}")
            else:
                out[g["sub"]] = (res, None)
        log(f"done  {group['label']}: " + ", ".join(f"{r[0]} rc={r[2]} {r[1]}s" for r in self.runs[-len(group['procs']):]))
        return out

    def run(self, label, procs, timeout, work=None):
        return self.wait(self.start(label, procs, work), timeout)


class Check:
    def __init__(self, key, title):
        self.key, self.title = key, title
        self.asserts, self.lines, self.errors, self.skips = [], [], [], []
        self.figures, self.not_run, self.raw = "", None, {}

    def expect(self, ok, text):
        self.asserts.append((bool(ok), text))
        return bool(ok)

    def error(self, err):
        self.errors.append(err)

    def skip(self, text):  # a part that could not run
        self.skips.append(text)

    def add(self, line=""):
        self.lines.append(line)

    @property
    def status(self):
        if self.not_run:
            return "NOT RUN"
        return "PASS" if not self.errors and self.asserts and all(ok for ok, _ in self.asserts) else "FAIL"

    def markdown(self):
        out = [f"## {self.key}: {self.title}: {self.status}", ""]
        if self.not_run:
            out += [f"Not run: {self.not_run}", ""]
        for e in self.errors:
            out += ["**Error:**", "", "```", e.strip()[-6000:], "```", ""]
        out += [f"- {'PASS' if ok else 'FAIL'}: {t}" for ok, t in self.asserts]
        out += [f"- NOT RUN: {t}" for t in self.skips]
        return "\n".join(out + [""] + self.lines + [""])


def results_or_errors(c, results):
    """The children's results by sub-label; every child error recorded on the check."""
    for err in (e for _, e in results.values() if e):
        c.error(err)
    return {sub: res for sub, (res, err) in results.items() if not err}


# ---- the checks ----------------------------------------------------------------------


def plan(args, n, total):
    """Sizes per check, scaled to the GPU count and the smallest GPU's memory (`total`)."""
    q = args.quick
    layer = int((0.25 if q else 1.5) * GiB)
    seed_layers = 8 if q else 32
    # The seed's producer KV + the decode buffers + the other decodes' peer-copy sources.
    while seed_layers > 4 and (seed_layers + 3 + max(0, n - 1)) * layer + n * GiB > 0.9 * total:
        seed_layers -= 2
    shifts = list(range(1, n)) or [0]
    return {
        "pools": dict(small_bytes=(16 if q else 64) * MiB, big_bytes=(256 * MiB if q else GiB), reps=3 if q else 5,
                      rounds=3, capacity_frac=0.05 if q else 0.5),
        "import": dict(bytes=(16 if q else 64) * MiB),
        "ddp": dict(steps=8 if q else 30, sizes=[MiB, 64 * MiB] + ([] if q else [512 * MiB]), rounds=3 if q else 5),
        "tp": dict(layers=2 if q else 16, hidden=2048 if q else 8192, ffn=8192 if q else 28672, heads=16 if q else 64,
                   head_dim=128, batch=4 if q else 8, window=64 if q else 256, steps=8 if q else 32,
                   kv_bytes=int(GiB if q else min(32 * GiB, 0.25 * total)), graph=args.tp_graph),
        "nixl": dict(layers=4 if q else 8, layer_bytes=layer, blocks=32 if q else 256, shifts=shifts),
        "seed": dict(layers=seed_layers, layer_bytes=layer, blocks=64 if q else 512,
                     shifts=[shifts[c % len(shifts)] for c in range(args.seed_cycles or (3 if q else 10))]),
    }


def check_pools(runner, n, sz, tol, torch_group):
    c = Check("pools", "per-device pools on every GPU in one process; copies and peer bandwidth between every pair")
    ctl = runner.wait(torch_group, 300)[""] if torch_group else (None, "not run")  # done before gpu-arena's
    r = runner.run("pools-arena", [("", "pools", dict(sz, mode="native"), None)], 300)[""]
    if r[1]:
        c.error(r[1])
        c.figures = "error"
        return c
    a, t = r[0], ctl[0]
    c.raw = {"arena": a, "torch": t, "torch_error": ctl[1]}
    c.expect(a["route"] == "native" and a["backend"] == "cuda",
             f"gpu-arena is torch's allocator (route {a['route']}, backend {a['backend']})")
    c.expect(a["gpu_arena_device_count"] == n and a["first_devices"] == [f"cuda:{d}" for d in range(n)]
             and all(a["in_own_arenas"]) and all(x > 0 for x in a["reserved_per_device"]),
             f"tensors on each of the {n} cuda:i lie in gpu-arena arenas of their own device; reserved per device: "
             + ", ".join(fmt_bytes(x) for x in a["reserved_per_device"]))
    rows = a["rows"]
    keys = ("memcpy_ok", "kernel_to_peer_ok", "kernel_into_early_arena_ok", "big_copy_ok", "peer_copy_ok")
    bad = [r["pair"] for r in rows if not all(r.get(k, True) for k in keys)]
    c.expect(not bad, f"every ordered pair ({len(rows)}): copy_, a kernel writing the peer's memory, a kernel "
             f"writing into the other GPU's arena, {fmt_bytes(sz['big_bytes'])} copy_ and cudaMemcpyPeer: bytes verified "
             f"(failing: {bad})")
    if n >= 2:
        early = [r for r in rows if r["arena_predates_peer"]]
        c.expect(early and all(r["kernel_into_early_arena_ok"] for r in early),
                 f"arenas made before a peer was first used are reachable from it: {len(early)} pairs (i < j) where a "
                 "kernel on GPU j wrote into GPU i's arena made before GPU j was touched")
    else:
        c.skip("an arena made before a peer was first used, written by that peer: needs 2+ GPUs: not run")
    tmap = {tuple(x["pair"]): x for x in (t or {}).get("rows", [])}
    if all("raw_peer_gbps" in r for r in rows):
        base, what = [r["raw_peer_gbps"] for r in rows], "cudaMemcpyPeer between cudaMalloc buffers, same process"
    elif tmap:
        base, what = [tmap[tuple(r["pair"])]["copy_gbps"] for r in rows], "copy_ with PyTorch's allocator (other process)"
    else:
        base, what = None, None
    if base:
        ratios = [r["copy_gbps"] / b for r, b in zip(rows, base) if b]
        c.expect(ratios and med(ratios) >= 0.9, f"peer copy bandwidth on gpu-arena memory: median {med(ratios):.2f}x "
                 f"{what} (min {min(ratios):.2f}x, max {max(ratios):.2f}x; >= 0.9 asserted)")
    else:
        c.skip(f"a bandwidth baseline: no libcudart ({a['cudart']}) and no PyTorch-allocator child ({ctl[1]})")
    for cap in a["capacity"]:
        c.expect(cap["verified"] and cap["reserved_after"] == cap["reserved_before"]
                 and abs(cap["free_before"] - cap["free_after"]) <= tol,
                 f"GPU {cap['device']}: {cap['gib']} x 1 GiB verified (reserved {fmt_bytes(cap['reserved_during'])}), "
                 f"freed: reserved back to {fmt_bytes(cap['reserved_after'])}, free memory "
                 f"{(cap['free_after'] - cap['free_before']) / MiB:+.1f} MiB vs before")
    c.expect(all(v == "ok" for v in a["validate"]), f"gpu_arena.validate() on every device: {a['validate']}")
    c.add(f"Peer-copy baseline library: `{a['cudart']}`. Bandwidth per ordered pair (GB/s; "
          f"{sz['big_bytes'] // MiB} MiB x {sz['reps']} copies, median of {sz['rounds']} rounds):")
    c.add("")
    c.add("| src -> dst | copy_ gpu-arena | cudaMemcpyPeer (gpu-arena buffers) | cudaMemcpyPeer (cudaMalloc) | "
          "copy_ PyTorch's allocator (control) | bytes ok |")
    c.add("|---|---|---|---|---|---|")
    for r in rows:
        tr = tmap.get(tuple(r["pair"]), {})
        c.add(f"| {r['pair'][0]} -> {r['pair'][1]} | {r['copy_gbps']} | {r.get('peer_gbps', '-')} | "
              f"{r.get('raw_peer_gbps', '-')} | {tr.get('copy_gbps', '-')} | {all(r.get(k, True) for k in keys)} |")
    if ctl[1]:
        c.add(f"\nPyTorch-allocator control failed: `{ctl[1][:400]}`")
    elif t:
        tbad = [r["pair"] for r in t["rows"] if not all(r.get(k, True) for k in keys)]
        c.add(f"\nPyTorch-allocator control: bytes verified on {len(t['rows']) - len(tbad)}/{len(t['rows'])} pairs.")
    cg = [r["copy_gbps"] for r in rows]
    c.figures = (f"{len(rows) - len(bad)}/{len(rows)} pairs verified; copy_ {min(cg)}-{max(cg)} GB/s"
                 + (f", {med(ratios):.2f}x baseline" if base else "")
                 + f"; {sum(x['gib'] for x in a['capacity'])} GiB at scale, back")
    return c


def check_import(runner, n, sz, tol, tmp):
    c = Check("import", "cross-device imports both ways between every pair (share on GPU i, open on GPU j)")
    work = tempfile.mkdtemp(prefix="import-", dir=tmp)
    common = dict(sz, n=n, work=work, timeout=240)
    procs = [(f"p{i}", "import_producer", dict(common, dev=i), None) for i in range(n)]
    procs += [(f"c{j}", "import_consumer", dict(common, dev=j), None) for j in range(n)]
    res = results_or_errors(c, runner.run("import", procs, 300, work))
    if c.errors:
        c.figures = "error"
        return c
    c.raw = res
    bad, opens, rows = [], [], []
    for i in range(n):
        for j in range(n):
            r, s = res[f"c{j}"]["rows"][str(i)], res[f"p{i}"]["seen"][str(j)]
            ok = (r["on_producer_device"] and r["read_ok"] and r["kernel_read_ok"] and r["closed"] == 1
                  and s["memcpy_write"] and s["kernel_write"] and s["rest_intact"])
            opens.append(r["open_ms"])
            rows.append(f"| {i} | {j} | {r['device']} | {r['open_ms']} | {r['read_ok']} / {r['kernel_read_ok']} | "
                        f"{s['memcpy_write']} / {s['kernel_write']} / {s['rest_intact']} |")
            if not ok:
                bad.append((i, j))
    cross = n * (n - 1)
    c.expect(not bad, f"{n * n} (producer GPU, consumer GPU) pairs, {cross} of them across devices: the consumer opened "
             "the share on the producer's GPU, copied it into its own GPU and ran a kernel over it (bytes verified), "
             f"wrote into it by a copy and by a kernel, and the producer saw both writes (failing: {bad})")
    if n < 2:
        c.skip("imports across devices: needs 2+ GPUs: not run (the pair (0, 0) ran: two processes on GPU 0)")
    live = {j: res[f"c{j}"]["imports_live_after_close"] for j in range(n)}
    c.expect(all(v == 0 for v in live.values()), f"every consumer closed its imports (imports_live: {live})")
    for i in range(n):
        p = res[f"p{i}"]
        gap = p["base_free"] - p["free_after"]
        c.expect(p["reserved_after"] == 0 and p["exports_after"] == 0 and abs(gap) <= tol
                 and p["consumers_alive_at_measure"],
                 f"GPU {i}: after unshare + free + empty_cache, reserved {fmt_bytes(p['reserved_after'])}, exports "
                 f"{p['exports_after']} (were {p['exports_live']}), free memory {-gap / MiB:+.1f} MiB vs baseline, "
                 f"consumers alive: {p['consumers_alive_at_measure']}")
    c.add(f"{sz['bytes'] // MiB} MiB int32 per (producer, consumer).")
    c.add("")
    c.add("| producer GPU | consumer GPU | imported on | open ms | read / kernel read | producer saw copy / kernel write / rest |")
    c.add("|---|---|---|---|---|---|")
    c.lines += rows
    c.figures = f"{n * n - len(bad)}/{n * n} pairs ok ({cross} cross-device); open median {med(opens):.2f} ms"
    return c


def run_ranks(runner, label, child, n, params, timeout):
    port = free_port()
    procs = [(f"r{r}", child, params, {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(n)]
    return runner.run(label, procs, timeout)


def reduce_stat(ranks, size):
    """All_reduce seconds per op of ``size`` bytes in one process group: the slowest rank's
    median over its rounds, and the largest spread of a rank's rounds ((max - min) / median)."""
    per = [x["timing"][str(size)]["s_per_op"] for x in ranks]
    return max(med(v) for v in per), max((max(v) - min(v)) / med(v) for v in per)


def noise_limit(spread_torch, spread_arena):
    """The largest gpu-arena / PyTorch all_reduce time ratio taken as noise: 1.10, or one
    plus both groups' spreads when they are wider."""
    return 1 + max(0.10, spread_torch + spread_arena)


def timing_within_noise(A, T, sz):
    """Whether gpu-arena's all_reduce time at every size >= 64 MiB is within the noise bound
    of PyTorch's (`noise_limit`)."""
    for size in (s for s in sz["sizes"] if s >= 64 * MiB):
        (tt, ts), (ta, sa) = reduce_stat(T, size), reduce_stat(A, size)
        if ta / tt > noise_limit(ts, sa):
            return False
    return True


def check_ddp(runner, n, sz):
    c = Check("ddp", f"DDP over NCCL, world size {n}, gpu-arena in every rank vs PyTorch's allocator")
    arena = results_or_errors(c, run_ranks(runner, "ddp-arena", "ddp", n, dict(sz, mode="arena"), 300))
    torch_ = results_or_errors(c, run_ranks(runner, "ddp-torch", "ddp", n, dict(sz, mode="torch"), 300))
    if c.errors:
        c.figures = "error"
        return c
    A, T = [arena[f"r{r}"] for r in range(n)], [torch_[f"r{r}"] for r in range(n)]
    c.raw = {"arena": A, "torch": T}
    c.expect(all(x["info"]["NCCL_NVLS_ENABLE"] == "0" for x in A + T), "NCCL_NVLS_ENABLE=0 in every rank")
    c.expect(all(x["info"].get("route") == "native" and x["info"]["alloc_count"] > 0 for x in A),
             f"gpu-arena served every rank (allocations: {[x['info']['alloc_count'] for x in A]})")
    c.expect(all(x["sum_ok"] for x in A + T), "an all_reduce of (rank + 1) sums to N(N+1)/2 in every rank")
    same = [a["losses"] == t["losses"] and a["global_losses"] == t["global_losses"] for a, t in zip(A, T)]
    c.expect(all(same), f"every rank's {sz['steps']} losses and the all-reduced losses bitwise equal to PyTorch's "
             f"allocator's (per rank: {same})")
    c.expect(all(a["digest"] == t["digest"] for a, t in zip(A, T)) and len({a["digest"] for a in A}) == 1,
             "final parameters bitwise equal to PyTorch's allocator's in every rank, and equal across ranks")
    c.expect(A[0]["losses"][-1] < A[0]["losses"][0], f"training made progress ({A[0]['losses'][0]:.5f} -> "
             f"{A[0]['losses'][-1]:.5f})")
    if not (all(same) and all(a["digest"] == t["digest"] for a, t in zip(A, T))) and runner.left() > 120:
        ctl = results_or_errors(Check("x", "x"), run_ranks(runner, "ddp-control", "ddp", n, dict(sz, mode="torch"), 240))
        if len(ctl) == n:
            det = all(ctl[f"r{r}"]["losses"] == T[r]["losses"] and ctl[f"r{r}"]["digest"] == T[r]["digest"] for r in range(n))
            c.add("Control (PyTorch's allocator again): " + ("bitwise equal to the first: the run is deterministic, "
                  "the difference comes with gpu-arena." if det else "NOT equal to the first either: the workload is not "
                  "deterministic across processes here."))
    # All_reduce time. One process's launch-bound ops can run 1.4x slower than the next's
    # (a fresh machine, H200 2026-12-04: 1.42x, then 1.02x / 1.00x / 0.90x in three more
    # runs of the same pair), so a pair outside the noise bound runs again in the other order
    # (PyTorch first), and each allocator is judged by its faster process.
    pairs = [(A, T)]
    if not timing_within_noise(A, T, sz) and runner.left() > 120:
        t2 = results_or_errors(c, run_ranks(runner, "ddp-torch-2", "ddp", n, dict(sz, mode="torch"), 300))
        a2 = results_or_errors(c, run_ranks(runner, "ddp-arena-2", "ddp", n, dict(sz, mode="arena"), 300))
        if len(t2) == n and len(a2) == n:
            A2, T2 = [a2[f"r{r}"] for r in range(n)], [t2[f"r{r}"] for r in range(n)]
            c.expect(all(a["losses"] == t["losses"] and a["digest"] == t["digest"] for a, t in zip(A2, T))
                     and all(t["losses"] == t0["losses"] for t, t0 in zip(T2, T)),
                     "the second pair (PyTorch first) trained bitwise equal to the first")
            pairs.append((A2, T2))
        c.add(f"The first pair (gpu-arena first) was outside the noise bound: both ran again, PyTorch first "
              f"({len(pairs)} pairs with results; each allocator's figure is its faster process).")
    c.add("| all_reduce size | PyTorch us/op | gpu-arena us/op | ratio | spread (PyTorch / gpu-arena) | bus GB/s (gpu-arena) |")
    c.add("|---|---|---|---|---|---|")
    worst = []
    for size in sz["sizes"]:
        (tt, ts), (ta, sa) = (min((reduce_stat(ranks, size) for ranks in side), key=lambda x: x[0])
                              for side in ([t for _, t in pairs], [a for a, _ in pairs]))
        ratio, lim = ta / tt, noise_limit(ts, sa)
        bus = (2 * (n - 1) / n if n > 1 else 1) * size / ta / 1e9
        c.add(f"| {fmt_bytes(size)} | {tt * 1e6:.1f} | {ta * 1e6:.1f} | {ratio:.3f} | {ts:.2f} / {sa:.2f} | {bus:.1f} |")
        worst.append(f"{fmt_bytes(size)} {ratio:.2f}x")
        if size >= 64 * MiB:
            c.expect(ratio <= lim, f"all_reduce of {fmt_bytes(size)}: gpu-arena {ta * 1e6:.1f} us/op vs PyTorch "
                     f"{tt * 1e6:.1f} ({ratio:.3f}x; within noise: <= {lim:.2f}x)")
    c.add("")
    c.add(f"Per-op time: the slowest rank's median over {sz['rounds']} rounds; spread = (max - min) / median of "
          f"the rounds. NCCL {A[0]['info']['nccl']}; NCCL's own words on NVLS in rank 0's log: "
          f"{nvls_lines(runner, 'ddp-arena-r0')}")
    c.figures = f"world {n}: losses {'bitwise equal' if all(same) else 'DIFFER'}; all_reduce time " + ", ".join(worst)
    return c


def nvls_lines(runner, tag):
    try:
        text = (runner.logs / f"{tag}.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    hits = [ln.strip()[-160:] for ln in text.splitlines() if "NVLS" in ln][:3]
    return "; ".join(f"`{h}`" for h in hits) or "(none)"


def check_tp(runner, n, sz, tol):
    c = Check("tp", f"tensor-parallel decode over {n} GPU(s): CUDA graphs, sleep/wake of every rank")
    res = run_ranks(runner, "tp", "tp", n, sz, 360)
    if all(r and r.get("capture_failed") for r, _ in res.values()) and sz["graph"] == "full" and runner.left() > 120:
        c.add(f"Full-step capture with the all_reduces inside failed on every rank "
              f"(`{res['r0'][0].get('capture_error')}`): rerun with piecewise graphs.")
        res = run_ranks(runner, "tp-piecewise", "tp", n, dict(sz, graph="piecewise"), 360)
    got = results_or_errors(c, res)
    if c.errors or any(x.get("capture_failed") for x in got.values()):
        c.expect(not any(x.get("capture_failed") for x in got.values()), "the decode step was captured")
        c.figures = "error"
        return c
    R = [got[f"r{r}"] for r in range(n)]
    c.raw = R
    x0 = R[0]
    c.expect(all(x["info"]["route"] == "native" and x["info"]["alloc_count"] > 0 for x in R),
             "gpu-arena is torch's allocator in every rank")
    c.expect(all(x["info"]["NCCL_NVLS_ENABLE"] == "0" for x in R), "NCCL_NVLS_ENABLE=0 in every rank")
    c.expect(all(x["finite"] and x["graph_vs_eager_close"] for x in R),
             f"CUDA graph ({x0['graph']}: {x0['graphs']} graph(s)) output close to eager in every rank (max |diff| "
             f"{max(x['graph_vs_eager_max_abs'] for x in R):.2e}; bitwise in {sum(x['graph_vs_eager_bitwise'] for x in R)}/{n})")
    c.expect(all(x["ranks_identical"] for x in R), "the graph's outputs are identical on every rank (all_reduce ran)")
    for x in R:
        tagged = x["weights_bytes"] + x["kv_bytes"]
        c.expect(x["freed_by_sleep"] >= 0.9 * tagged and x["sleeping_bytes"] >= 0.9 * tagged,
                 f"rank {x['info']['rank']}: sleep gave {fmt_bytes(x['freed_by_sleep'])} back to the driver of "
                 f"{fmt_bytes(tagged)} weights + KV (sleeping {fmt_bytes(x['sleeping_bytes'])}) in {x['sleep_s']} s")
        back = x.get("free_host_released", x["free_awake"])
        c.expect(x["weights_same"] and x["addresses_same"] and x["sleeping_after_wake"] == 0
                 and x["replay_after_wake_bitwise"] and abs(back - x["free_before_sleep"]) <= tol,
                 f"rank {x['info']['rank']}: woke in {x['wake_s']} s at the same addresses, weights bitwise equal: "
                 f"{x['weights_same']}, graph replay bitwise equal to before: {x['replay_after_wake_bitwise']}, free "
                 f"memory {(back - x['free_before_sleep']) / MiB:+.1f} MiB vs before the sleep once the kept host "
                 f"buffers are released ({(x['free_awake'] - x['free_before_sleep']) / MiB:+.1f} MiB while kept)")
    c.expect(max(x["asleep_at"] for x in R) <= min(x["wake_at"] for x in R), "every rank was asleep at the same time")
    c.add(f"{x0['layers']} layers, hidden {x0['hidden']}, {x0['heads_local']} heads x 128 and an MLP slice of "
          f"{x0['ffn_local']} per rank, batch {x0['batch']}, attention window {x0['window']}, {x0['steps']} steps; "
          f"per rank {fmt_bytes(x0['weights_bytes'])} weights, {fmt_bytes(x0['kv_bytes'])} KV cache "
          f"({x0['kv_slots']:,} slots). Step: eager {x0['eager_step_ms']} ms, graph {x0['graph_step_ms']} ms (rank 0).")
    c.figures = (f"{x0['graph']} graph {x0['graph_step_ms']} ms/step vs eager {x0['eager_step_ms']}; sleep "
                 f"{max(x['sleep_s'] for x in R)} s / wake {max(x['wake_s'] for x in R)} s, "
                 f"{fmt_bytes(min(x['freed_by_sleep'] for x in R))}+ freed per GPU")
    return c


def check_nixl(runner, n, sz, tol, tmp, key, prep):
    seed = key == "seed"
    c = Check(key, "the seed flow across GPUs (NIXL GPU_ARENA, in-process shutdowns)" if seed
              else "NIXL's GPU_ARENA backend between GPU pairs: bandwidth, revocation, memory back")
    if prep.get("nixl_error"):
        c.not_run = f"NIXL unavailable: {prep['nixl_error'][:300]}"
        return c
    work = tempfile.mkdtemp(prefix=f"{key}-", dir=tmp)
    common = dict(sz, n=n, work=work, timeout=240)
    procs = [(f"prefill{i}", "prefill", dict(common, dev=i), None) for i in range(n)]
    procs += [(f"decode{j}", "decode", dict(common, dev=j), None) for j in range(n)]
    res = results_or_errors(c, runner.run(key, procs, 560 if seed else 400, work))
    if c.errors:
        c.figures = "error"
        return c
    c.raw = res
    P = {i: [x for x in res[f"prefill{i}"]["cycles"] if x["cycle"] != "w"] for i in range(n)}
    D = {j: [x for x in res[f"decode{j}"]["cycles"] if x["cycle"] != "w"] for j in range(n)}
    dec = [r for j in range(n) for r in D[j]]
    pre = [r for i in range(n) for r in P[i]]
    ncyc = len(sz["shifts"])
    c.expect(all(len(P[i]) == ncyc and len(D[i]) == ncyc for i in range(n)), f"{ncyc} cycle(s) on every GPU")
    pairs = sorted({(r["producer"], r["consumer"]) for r in dec})
    if not seed:
        want = [(i, j) for i in range(n) for j in range(n) if i != j] or [(0, 0)]
        c.expect(pairs == want, f"every ordered pair read once: {len(pairs)} of {len(want)}")
    if n < 2:
        c.skip("prefill and decode on different GPUs: needs 2+ GPUs: not run (the pair (0, 0) ran)")
    c.expect(dec and all(r["verified"] for r in dec),
             f"every READ verified: {sz['blocks']} x 2 MiB blocks over {sz['layers']} layers and 2 whole layers of "
             f"{fmt_bytes(sz['layer_bytes'])}, {len(dec)} (producer, consumer, cycle) reads")
    c.expect(all(r["read_after_revocation"].startswith("refused") and r["imports_after_revocation"] == 0 for r in dec),
             "revocation: after the prefill's deregister every decode holds no mapping (imports_live 0; had "
             f"{sorted({r['imports_while_registered'] for r in dec})}) and a READ is refused "
             f"(`{dec[0]['read_after_revocation'][:120] if dec else ''}`)")
    c.expect(all(1 <= r["exports"] <= r["layers"] and r["exports_after"] == 0 and r["reserved_after"] == 0 for r in pre),
             f"one export per arena (per cycle: {sorted({r['exports'] for r in pre})} for {sz['layers']} layers), none "
             "left, nothing reserved after the shutdown")
    lp = [r["leaked"] for r in pre]
    ld = [r["leaked"] for r in dec]
    c.expect(lp and ld and max(map(abs, lp)) <= tol and max(map(abs, ld)) <= tol
             and all(r["decoders_alive"] for r in pre) and all(r["prefills_alive"] for r in dec),
             f"memory back on both GPUs every cycle with both processes alive: prefill GPUs off their baseline by at "
             f"most {max(map(abs, lp or [0])) / MiB:.1f} MiB, decode GPUs {max(map(abs, ld or [0])) / MiB:.1f} MiB")
    ratios = [r["layers_gbps"] / r["peer_copy_gbps"] for r in dec if r["peer_copy_gbps"]]
    if not seed:
        c.expect(ratios and med(ratios) >= 0.5, f"layer READ bandwidth: median {med(ratios):.2f}x the same-run peer "
                 f"copy (min {min(ratios or [0]):.2f}x; >= 0.5 asserted)")
    c.add(f"{sz['layers']} x {fmt_bytes(sz['layer_bytes'])} KV per prefill, {sz['blocks']} blocks of 2 MiB, "
          f"{ncyc} cycle(s); shifts {sz['shifts']}; plugin {prep.get('nixl_package')}.")
    c.add("")
    c.add("| cycle | prefill GPU -> decode GPU | blocks GB/s | layers GB/s | peer copy GB/s | device copy GB/s | "
          "verified | READ after revocation | leak prefill / decode MiB |")
    c.add("|---|---|---|---|---|---|---|---|---|")
    pmap = {(r["cycle"], i): r for i in range(n) for r in P[i]}
    for r in sorted(dec, key=lambda r: (r["cycle"], r["producer"])):
        pr = pmap.get((r["cycle"], r["producer"]), {})
        c.add(f"| {r['cycle']} | {r['producer']} -> {r['consumer']} | {r['blocks_gbps']} | {r['layers_gbps']} | "
              f"{r['peer_copy_gbps']} | {r['copy_gbps']} | {r['verified']} | {r['read_after_revocation'][:40]} | "
              f"{pr.get('leaked', 0) / MiB:+.1f} / {r['leaked'] / MiB:+.1f} |")
    lg = [r["layers_gbps"] for r in dec]
    c.figures = (f"{len(dec)} reads verified; layers {min(lg or [0])}-{max(lg or [0])} GB/s"
                 + (f" ({med(ratios):.2f}x peer copy)" if ratios else "")
                 + f"; leak max {max(map(abs, lp + ld or [0])) / MiB:.1f} MiB")
    return c


# ---- main ----------------------------------------------------------------------------


def prepare_env():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_NVLS_ENABLE="0",
               NCCL_DEBUG=env.get("NCCL_DEBUG", "INFO"), NCCL_DEBUG_SUBSYS=env.get("NCCL_DEBUG_SUBSYS", "INIT,ENV"))
    staged = ROOT / ".gpu" / "libgpu_arena.so"
    if not env.get("GPU_ARENA_LIB") and staged.is_file():
        env["GPU_ARENA_LIB"] = str(staged)
    notes = {"GPU_ARENA_LIB": env.get("GPU_ARENA_LIB", "(not set: the package's own)")}
    if any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")):
        notes["nixl"] = "importable"
        return env, notes
    site, wheels = "/tmp/nixl-site", sorted(glob.glob(str(ROOT / ".gpu" / "wheels" / "nixl_cu13-*.whl")))
    if not os.path.isdir(site) and wheels:
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                            site, wheels[-1]], capture_output=True, text=True, timeout=300)
        if p.returncode:
            notes["nixl"] = f"pip install {wheels[-1]} failed: {' '.join(p.stderr.split())[-300:]}"
    if os.path.isdir(site):
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
        notes.setdefault("nixl", f"{site} ({wheels[-1] if wheels else 'installed before'})")
    notes.setdefault("nixl", "no nixl module and no .gpu/wheels/nixl_cu13-*.whl")
    return env, notes


def write_report(out, args_text, prep, notes, checks, runner):
    table = ["| check | result | key figures |", "|---|---|---|"]
    table += [f"| {c.key} | {c.status} | {c.figures or c.not_run or ''} |".replace("\n", " ") for c in checks]
    devs = prep.get("devices", [])
    lines = ["# gpu-arena on several GPUs of one host (issue #27)", "",
             f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}; host {platform.node()}; "
             f"{time.time() - T_START:.0f} s so far",
             f"- GPUs: {len(devs)} x {devs[0]['name'] if devs else '?'} ({fmt_bytes(devs[0]['total']) if devs else '?'}); "
             f"peer access: {prep.get('peer_access', '?')}",
             f"- torch {prep.get('torch', '?')} (CUDA {prep.get('cuda', '?')}, NCCL {prep.get('nccl', '?')}); python "
             f"{prep.get('python', '?')}; gpu-arena `{prep.get('lib', notes.get('GPU_ARENA_LIB'))}`, backend "
             f"{prep.get('backend', '?')}, route {prep.get('route', '?')} (install {prep.get('install_s', '?')} s)",
             f"- NIXL: {notes.get('nixl')}; plugin {prep.get('nixl_plugin_dir', prep.get('nixl_error', '?'))}",
             f"- cudaMemcpyPeer through `{prep.get('cudart')}` ({prep.get('cudart_how', '')})",
             f"- command: `python3 {SCRIPT.relative_to(ROOT) if SCRIPT.is_relative_to(ROOT) else SCRIPT} {args_text}`; "
             "children env: NCCL_NVLS_ENABLE=0, CUBLAS_WORKSPACE_CONFIG=:4096:8", ""]
    lines += table + [""] + [c.markdown() for c in checks]
    lines += ["## Children", "", "| child | wall s | exit |", "|---|---|---|"]
    lines += [f"| {t} | {w} | {rc} |" for t, w, rc in runner.runs]
    (out / "multi_gpu.md").write_text("\n".join(lines) + "\n")
    (out / "multi_gpu.json").write_text(json.dumps(
        {"prep": prep, "notes": notes, "args": args_text, "total_s": round(time.time() - T_START, 1), "runs": runner.runs,
         "checks": {c.key: {"status": c.status, "figures": c.figures, "not_run": c.not_run, "asserts": c.asserts,
                            "skipped_parts": c.skips, "errors": c.errors, "raw": c.raw} for c in checks}},
        indent=1, default=str))
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    ap.add_argument("--quick", action="store_true", help="smaller sizes, 3 seed cycles: a dry run")
    ap.add_argument("--seed-cycles", type=int, default=0, help="seed cycles (default 10, --quick 3)")
    ap.add_argument("--tp-graph", choices=("full", "piecewise"), default="full")
    ap.add_argument("--tol-mib", type=float, default=4.0, help="memory back: free memory within this of the baseline")
    ap.add_argument("--budget-s", type=float, default=580, help="no check starts (and children are stopped) past it")
    ap.add_argument("--out", default=out_path())
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if set(only) - set(CHECKS):
        ap.error(f"unknown check(s): {', '.join(sorted(set(only) - set(CHECKS)))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args_text = " ".join(argv if argv is not None else sys.argv[1:])
    tol = int(args.tol_mib * MiB)
    env, notes = prepare_env()
    checks = []
    with tempfile.TemporaryDirectory(prefix="gpu_multi_gpu_") as tmp:
        tmp = Path(tmp)
        runner = Runner(out, tmp, env, T_START + args.budget_s)
        prep_g = runner.start("prep", [("", "prep", {}, None)])
        ctl = None
        if "pools" in only:  # the PyTorch-allocator control needs no build: beside the prep
            ctl = runner.start("pools-torch", [("", "pools", dict(plan(args, 1, 80 * GiB)["pools"], mode="torch"), None)])
        prep, prep_err = runner.wait(prep_g, 400)[""]
        prep = prep or {}
        if prep_err:
            c = Check("prep", "install gpu-arena (native), build the NIXL plugin, read the machine")
            c.error(prep_err)
            c.figures = "failed: " + prep_err.split("--- log tail")[0].strip().splitlines()[-1][:200]
            checks.append(c)
        n = len(prep.get("devices", []))
        total = min((d["total"] for d in prep.get("devices", [])), default=0)
        sizes = plan(args, n, total) if n else {}

        def done(*new):
            checks.extend(new)
            return write_report(out, args_text, prep, notes, checks, runner)

        for key in only:
            c = None
            if prep_err or not n:
                c = Check(key, key)
                c.not_run = "prep failed" if prep_err else "no GPU"
            elif runner.left() < 45:
                c = Check(key, key)
                c.not_run = f"out of time (--budget-s {args.budget_s:.0f}): run it with --only {key}"
            if c:
                c.figures = ""
                done(c)
                continue
            try:
                log(f"check {key} ({runner.left():.0f} s left)")
                if key == "pools":
                    c = check_pools(runner, n, sizes["pools"], tol, ctl)
                    ctl = None
                elif key == "import":
                    c = check_import(runner, n, sizes["import"], tol, tmp)
                elif key == "ddp":
                    c = check_ddp(runner, n, sizes["ddp"])
                elif key == "tp":
                    c = check_tp(runner, n, sizes["tp"], tol)
                else:
                    c = check_nixl(runner, n, sizes[key], tol, tmp, key, prep)
            except Exception:  # noqa: BLE001 - a bug here must still give a report
                c = Check(key, f"{key} (the check's evaluation crashed)")
                c.error(traceback.format_exc())
            done(c)
        if ctl is not None:  # prep failed before pools could collect it
            runner.wait(ctl, 5)
        table = done()
    failed = [c.key for c in checks if c.status == "FAIL"]
    log(f"report: {out / 'multi_gpu.md'}; " + ("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}"))
    print("\n".join(table))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
