#!/usr/bin/env python3
"""Cross-process sharing with gpu-arena on a real GPU: the figures of the IPC issue
(shared/seed/rocm-ipc-pin-request.txt), as a markdown report.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so PYTHONPATH=python python3 tests/gpu/gpu_ipc_check.py
    python3 tests/gpu/gpu_ipc_check.py --sim        # the same plumbing on the sim backend,
                                                  # no torch, no GPU, sizes / 1024

Sections:
  (a) the seed's reproduction with gpu-arena (50 GiB tensor shared with a consumer, then
      freed: "Leaked: 0.0 GB"), and the naive flow on the CUDA driver API (cuMemCreate +
      cuMemExportToShareableHandle, everything released but the fd: "Leaked: 50.0 GB"
      until close(fd)) to show the cause;
  (b) a vLLM-shaped engine (32 layers x 1 GiB bf16 KV tensors) created, shared with a
      consumer that opens and reads every layer, and destroyed, 10 times in one producer:
      device free memory after each cycle must stay flat;
  (c) a consumer SIGKILLed while it holds imports (the producer gets everything back), and
      a producer SIGKILLed while a consumer holds an import (the consumer's mapping stays
      valid, and closing it gives the memory back);
  (d) figures: share + first import latency, import of another share of an arena already
      imported, and the number of driver exports to share a 16 GiB KV cache block by block.

Every process is fresh and installs gpu-arena before touching CUDA; producers and consumers
are tests/gpu/gpu_ipc_consumer.py workers driven over pipes with timeouts, and share handles
travel between them as bytes (Share.to_bytes, base64). The report goes to stdout and, when
OUT is set, to $OUT/ipc_report.md. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import gpu_common  # beside this file: python/ and tests/python/ on sys.path
from naive_export import TOL, gb  # beside this file; one tolerance, one format
from result_channel import NO_RESULT, ReplyPipe, run_reporting  # tests/python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "gpu_ipc_consumer.py")
NAIVE = os.path.join(HERE, "naive_export.py")  # section (a'), in a process of its own

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def log(msg: str) -> None:
    print(f"[gpu_ipc_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def mib(x: float) -> str:
    return f"{x / MiB:+.1f} MiB"


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


class Report:
    def __init__(self):
        self.lines: List[str] = []
        self.checks: List[tuple] = []  # (section, name, ok, detail)
        self.section = ""

    def h(self, title: str) -> None:
        self.section = title.split()[0]
        self.lines += ["", f"## {title}", ""]
        log(title)

    def p(self, text: str = "") -> None:
        self.lines += [text, ""]

    def code(self, text: str) -> None:
        self.lines += ["```", text.rstrip("\n"), "```", ""]

    def table(self, headers: List[str], rows: List[List[Any]]) -> None:
        self.lines.append("")
        self.lines.append("| " + " | ".join(headers) + " |")
        self.lines.append("|" + "---|" * len(headers))
        for r in rows:
            self.lines.append("| " + " | ".join(str(c) for c in r) + " |")
        self.lines.append("")

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((self.section, name, bool(ok), detail))
        log(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
        return bool(ok)

    def failed(self) -> List[tuple]:
        return [c for c in self.checks if not c[2]]

    def render(self, header: List[str]) -> str:
        out = list(header)
        out += ["", "## Checks", ""]
        out.append("| section | check | result | detail |")
        out.append("|---|---|---|---|")
        for sec, name, ok, detail in self.checks:
            out.append(f"| {sec} | {name} | {'PASS' if ok else '**FAIL**'} | {detail} |")
        n_fail = len(self.failed())
        out += ["", f"**{len(self.checks) - n_fail} passed, {n_fail} failed**"]
        out += self.lines
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """A tests/gpu/gpu_ipc_consumer.py process; call(op, **args) -> its result."""

    live: List["Worker"] = []
    first_info: Dict[str, Any] = {}

    def __init__(self, role: str, mode: str, conf: Optional[str], start_timeout: float = 240):
        self.role = role
        env = gpu_common.child_env(drop=())
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, WORKER, "--mode", mode]
        if conf:
            cmd += ["--conf", conf]
        t0 = time.monotonic()
        self.pipe = ReplyPipe()  # its answers; its stdout is a log, passed on to stderr
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=None, text=True, bufsize=1,
                                         env={**env, **self.pipe.env}, pass_fds=(self.pipe.fd,))
        finally:
            self.pipe.started()
        Worker.live.append(self)
        self.replies: "queue.Queue[Optional[dict]]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        first = self._reply(start_timeout, "start-up")
        if "ready" not in first:
            self.kill()
            raise WorkerFailed(f"{role}: {first.get('error')}\n{first.get('trace', '')}")
        self.pid = int(first["ready"])
        self.info = first.get("info", {})
        if not Worker.first_info:
            Worker.first_info.update(self.info)
        self.start_seconds = time.monotonic() - t0
        log(f"{role}: pid {self.pid} ready in {self.start_seconds:.1f} s")

    def _pump(self) -> None:
        for line in self.pipe.reader:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                sys.stderr.write(f"[{self.role}] bad reply: {line}")
        self.replies.put(None)

    def _pump_stdout(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                sys.stderr.write(f"[{self.role} stdout] {line}")

    def _reply(self, timeout: float, what: str) -> dict:
        try:
            r = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerFailed(f"{self.role}: no answer to {what} within {timeout:.0f} s "
                               "(killed it)") from None
        if r is None:
            rc = self.proc.wait(timeout=10)
            raise WorkerFailed(f"{self.role}: exited (status {rc}) during {what}")
        return r

    def call(self, op: str, timeout: float = 180, **args) -> Any:
        if self.proc.poll() is not None:
            raise WorkerFailed(f"{self.role}: not running (status {self.proc.returncode})")
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        r = self._reply(timeout, op)
        if "error" in r:
            raise WorkerFailed(f"{self.role}: {r['error']}\n{r.get('trace', '')}")
        return r.get("ok")

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda timeout=180, **args: self.call(op, timeout=timeout, **args)

    def exit(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
                self.proc.wait(timeout=timeout)
            except (WorkerFailed, OSError, subprocess.TimeoutExpired) as e:
                log(f"{self.role}: exit failed ({e}); killing it")
                self.kill()
        self._forget()

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Send `sig` and reap the process; returns the seconds until it was gone."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._forget()
        return time.monotonic() - t0

    def _forget(self) -> None:
        if self in Worker.live:
            Worker.live.remove(self)
        for f in (self.proc.stdin,):
            try:
                f.close()
            except OSError:
                pass

    @classmethod
    def kill_all(cls) -> None:
        for w in list(cls.live):
            w.kill()


# --------------------------------------------------------------------------------------
# Configuration of a run
# --------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, sim: bool, args):
        self.sim = sim
        self.mode = "sim" if sim else "torch"
        self.div = 1024 if sim else 1           # sizes are divided by this in --sim
        # validate=0: a debug build checks every invariant after each operation by default,
        # which makes thousands of blocks quadratic; this check is about memory, not that.
        sim_conf = "backend=sim,sim_capacity=64GiB,sim_granularity=4KiB,validate=0"
        self.producer_conf = (f"{sim_conf},arena_size=2MiB" if sim
                              else "backend=cuda,arena_size=1GiB,validate=0")
        self.consumer_conf = (f"{sim_conf},arena_size=2MiB" if sim
                              else "backend=cuda,arena_size=64MiB,validate=0")
        self.args = args

    def size(self, nbytes: int) -> int:
        return nbytes // self.div

    def stride(self, elements: int) -> int:
        return max(1, elements // self.div)

    def producer(self, role: str = "producer") -> Worker:
        return Worker(role, self.mode, self.producer_conf)

    def consumer(self, role: str = "consumer") -> Worker:
        return Worker(role, self.mode, self.consumer_conf)


def poll(fn: Callable[[], Any], until: Callable[[Any], bool], timeout: float,
         every: float = 0.05):
    """Call fn() until until(value) or timeout; returns (value, seconds, reached)."""
    t0 = time.monotonic()
    while True:
        v = fn()
        if until(v):
            return v, time.monotonic() - t0, True
        if time.monotonic() - t0 > timeout:
            return v, time.monotonic() - t0, False
        time.sleep(every)


def expect_sums(rep: Report, what: str, results: List[dict], values: List[float]) -> bool:
    ok = True
    bad = []
    for r, v in zip(results, values):
        want = r["count"] * v
        if not (r["marks"] == want and r["total"] == want):
            ok = False
            bad.append(f"marks {r['marks']} total {r['total']} want {want}")
    rep.check(what, ok, f"{len(results)} tensors" + (f"; {bad[:3]}" if bad else ""))
    return ok


# --------------------------------------------------------------------------------------
# (a) the seed's reproduction
# --------------------------------------------------------------------------------------


def section_a(ctx: Ctx, rep: Report) -> None:
    big = ctx.size(50 * GiB)
    stride = ctx.stride(1 << 20)
    rep.h("(a) The seed's reproduction, with gpu-arena")
    rep.p(f"A fresh producer installs gpu-arena (`gpu_arena.torch.install()`, which must come "
          f"before CUDA is initialized), warms up its kernels, and only then reads the baseline "
          f"with `torch.cuda.mem_get_info()` (that call initializes CUDA, so it cannot come "
          f"before install()). It allocates one `torch.zeros({big // 4}, float32)` "
          f"({human(big)}) through gpu-arena, writes 1.0 every {stride} elements, shares it "
          f"(`gpu_arena.share`); a fresh consumer opens it (`gpu_arena.open`, the Share pickled), "
          f"sums it, writes one element back, closes and exits; the producer then does what "
          f"the seed does: unshare, `del t`, `gc.collect()`, `torch.cuda.empty_cache()`.")
    P = ctx.producer()
    free0, total = P.mem()
    before = f"Before: {gb(free0)} free / {gb(total)} total"
    P.alloc(names=["t"], shape=[big // 4], dtype="float32", mark_stride=stride,
            mark_values=[1.0], timeout=300)
    free_alloc, _ = P.mem()
    C = ctx.consumer()
    sh = P.share(names=["t"])
    r = C.open(items=[{"name": "t", "b64": sh[0]["b64"]}], mark_stride=stride, pickled=True,
               timeout=300)
    expect_sums(rep, "consumer reads the producer's 50 GiB tensor", r, [1.0])
    C.write(name="t", index=1, value=5.0)
    seen = P.read(name="t", index=1)
    rep.check("producer sees the consumer's write", seen == 5.0, f"read {seen}")
    free_shared, _ = P.mem()
    closed = C.close(names=["t"], how="explicit")
    rep.check("consumer closed its import", closed["imports_live"] == 0,
              f"imports_live {closed['imports_live']}")
    C.exit()
    waited = P.wait_imports_zero(timeout=5)
    P.unshare(names=["t"])
    P.free(names=["t"])
    ec = P.empty_cache()
    (free_after, _), secs, _ = poll(lambda: P.mem(), lambda v: abs(free0 - v[0]) <= TOL, 10)
    st = P.stats()
    P.exit()
    leaked = free0 - free_after
    out = "\n".join([
        before,
        f"After allocating: {gb(free_alloc)} free",
        f"While shared and imported: {gb(free_shared)} free",
        f"After:  {gb(free_after)} free",
        f"Leaked: {leaked / 1024**3:.1f} GB",
    ])
    rep.code(out)
    rep.p(f"Exactly: {leaked} bytes ({mib(leaked)}); producer stats after: reserved_bytes "
          f"{st['reserved_bytes']}, exports_live {st['exports_live']}, shares_live "
          f"{st['shares_live']}, imports_live {st['imports_live']}, exports_total "
          f"{st['exports_total']}; the broker saw the consumer's close "
          f"{waited * 1e3:.1f} ms after it returned; back to baseline {secs:.2f} s after "
          f"empty_cache.")
    rep.check("Leaked: 0.0 GB (within 2 MiB)", abs(leaked) <= TOL, mib(leaked))
    rep.check("torch.cuda.empty_cache() alone hands gpu-arena's arenas back",
              ec["reserved_after_torch_empty_cache"] == 0,
              f"reserved after torch.cuda.empty_cache(): {ec['reserved_after_torch_empty_cache']}")
    rep.check("one driver export for the share", st["exports_total"] == 1,
              f"exports_total {st['exports_total']}")


def section_a_naive(ctx: Ctx, rep: Report) -> None:
    rep.h("(a') The naive flow on the CUDA driver API (the cause)")
    if ctx.sim:
        rep.p("Skipped in --sim (needs libcuda).")
        return
    size = 50 * GiB
    rep.p("A fresh process without gpu-arena or torch, through ctypes on libcuda.so.1: "
          "cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemCreate (pinned, device, "
          "POSIX fd handle type), cuMemAddressReserve, cuMemMap, cuMemSetAccess, "
          "cuMemExportToShareableHandle, then cuMemUnmap + cuMemRelease + cuMemAddressFree, "
          "keeping the fd open; then close(fd).")
    cmd = [sys.executable, NAIVE, str(size)]
    res, p = run_reporting(cmd, timeout=300)
    if p.returncode != 0 or res is NO_RESULT:
        rep.code(p.stdout + p.stderr)
        rep.check("naive driver flow ran", False, f"status {p.returncode}")
        return
    rep.code(res["text"])
    leaked_open = res["free0"] - res["free_fd_open"]
    leaked_closed = res["free0"] - res["free_closed"]
    rep.p(f"cuMemExportToShareableHandle took {res['export_ms']:.2f} ms; after close(fd) the "
          f"memory was back within {res['closed_seconds'] * 1e3:.1f} ms.")
    rep.check("naive flow: Leaked: 50.0 GB while the fd is open",
              abs(leaked_open - size) <= 64 * MiB, gb(leaked_open))
    rep.check("naive flow: back after close(fd)", abs(leaked_closed) <= TOL, mib(leaked_closed))


# --------------------------------------------------------------------------------------
# (b) a vLLM-shaped engine, 10 cycles
# --------------------------------------------------------------------------------------


def section_b(ctx: Ctx, rep: Report) -> None:
    layers, cycles = ctx.args.layers, ctx.args.cycles
    shape = [2, 16384 // ctx.div, 16, 8, 128]  # K and V, blocks, block size, kv heads, head dim
    per = 2
    for s in shape:
        per *= s
    stride = ctx.stride(1 << 16)
    rep.h(f"(b) A vLLM-shaped engine: {layers} layers x {human(per)} bf16, {cycles} cycles")
    rep.p(f"One producer process (`{ctx.producer_conf}`) and one consumer process for all cycles; "
          f"the consumer starts first so both are in the baseline. Each cycle: the producer "
          f"allocates one KV tensor per layer, shape {tuple(shape)} bf16, with the layer's "
          f"number written every {stride} elements; shares every layer; the consumer opens "
          f"them all (odd cycles from Share.to_bytes, even cycles through pickle), checks "
          f"every layer's sum, writes into layer 0 (the producer checks it) and closes them "
          f"(odd cycles `gpu_arena.close`, even cycles by dropping the tensors: the garbage "
          f"collector closes them); the producer unshares, `del`s, `gc.collect()`s and "
          f"`torch.cuda.empty_cache()`s. Free memory read by the producer after each cycle.")
    C = ctx.consumer()
    P = ctx.producer()
    free0, total = P.mem()
    names = [f"L{i}" for i in range(layers)]
    values = [float(i + 1) for i in range(layers)]
    rows, frees, ok_sums, ok_write, ok_state = [], [], True, True, True
    for cycle in range(1, cycles + 1):
        t0 = time.monotonic()
        P.alloc(names=names, shape=shape, dtype="bfloat16", mark_stride=stride,
                mark_values=values, timeout=300)
        sh = P.share(names=names)
        items = [{"name": n, "b64": s["b64"]} for n, s in zip(names, sh)]
        res = C.open(items=items, mark_stride=stride, pickled=(cycle % 2 == 0), timeout=300)
        for r, v in zip(res, values):
            want = r["count"] * v
            if not (r["marks"] == want and r["total"] == want):
                ok_sums = False
        C.write(name="L0", index=1, value=7.0)
        seen = P.read(name="L0", index=1)
        ok_write &= seen == 7.0
        how = "explicit" if cycle % 2 else "gc"
        closed = C.close(names=names, how=how)
        C.empty_cache()
        P.wait_imports_zero(timeout=5)
        P.unshare(names=names)
        P.free(names=names)
        ec = P.empty_cache()
        st = P.stats()
        free, _ = P.mem()
        dt = time.monotonic() - t0
        frees.append(free)
        ok_state &= (closed["imports_live"] == 0 and ec["reserved"] == 0
                     and st["shares_live"] == 0 and st["exports_live"] == 0
                     and st["imports_live"] == 0)
        rows.append([cycle, gb(free), mib(free - free0), mib(free - frees[0]),
                     st["reserved_bytes"], st["exports_total"], how,
                     f"{1e3 * statistics.median(r['dt'] for r in res):.2f}", f"{dt:.2f}"])
        log(f"cycle {cycle}: free {gb(free)} ({mib(free - free0)} vs baseline)")
    C.exit()
    P.exit()
    rep.p(f"Baseline (both processes up, nothing allocated): {gb(free0)} free of {gb(total)}.")
    rep.table(["cycle", "free after", "vs baseline", "vs cycle 1", "reserved_bytes",
               "exports_total", "consumer close", "open() median ms", "cycle s"], rows)
    worst1 = max(abs(f - frees[0]) for f in frees)
    worst0 = max(abs(f - free0) for f in frees)
    rep.check("every layer read correctly in every cycle", ok_sums)
    rep.check("producer sees the consumer's writes", ok_write)
    rep.check("after each cycle: no share, export, import or reserved byte left", ok_state)
    rep.check("free memory flat: within 2 MiB of cycle 1", worst1 <= TOL, f"worst {mib(worst1)}")
    rep.check("free memory flat: within 2 MiB of baseline", worst0 <= TOL, f"worst {mib(worst0)}")


# --------------------------------------------------------------------------------------
# (c) SIGKILL
# --------------------------------------------------------------------------------------


def section_c_consumer(ctx: Ctx, rep: Report) -> None:
    layers = 8
    shape = [2, 16384 // ctx.div, 16, 8, 128]
    stride = ctx.stride(1 << 16)
    rep.h("(c1) A consumer SIGKILLed while it holds imports")
    rep.p(f"The producer reads its baseline before the consumer exists, allocates {layers} "
          f"KV layers ({human(layers * 2 * 16384 * 16 * 8 * 128 * 2 // ctx.div)}), shares them; "
          f"a fresh consumer opens and reads all, then gets SIGKILL. The producer polls "
          f"`gpu_arena.stats()['imports_live']` until the broker dropped the dead peer's "
          f"leases, then unshares, frees and empties its cache.")
    P = ctx.producer()
    free0, _ = P.mem()
    names = [f"K{i}" for i in range(layers)]
    values = [float(i + 1) for i in range(layers)]
    P.alloc(names=names, shape=shape, dtype="bfloat16", mark_stride=stride, mark_values=values)
    sh = P.share(names=names)
    C = ctx.consumer()
    res = C.open(items=[{"name": n, "b64": s["b64"]} for n, s in zip(names, sh)],
                 mark_stride=stride)
    expect_sums(rep, "consumer read every layer before it was killed", res, values)
    live = P.stats()["imports_live"]
    gone = C.kill(signal.SIGKILL)
    waited = P.wait_imports_zero(timeout=10)
    P.unshare(names=names)
    P.free(names=names)
    ec = P.empty_cache()
    (free1, _), secs, _ = poll(lambda: P.mem(), lambda v: abs(free0 - v[0]) <= TOL, 10)
    P.exit()
    rep.table(["imports before kill", "kill -> reaped", "reaped -> imports_live 0",
               "reserved after empty_cache", "free vs baseline", "time to baseline"],
              [[live, f"{gone * 1e3:.1f} ms", f"{waited * 1e3:.1f} ms", ec["reserved"],
                mib(free1 - free0), f"{secs:.2f} s"]])
    rep.check("broker dropped the killed consumer's leases", live == layers,
              f"{live} imports before, 0 after {waited * 1e3:.1f} ms")
    rep.check("memory back within 2 MiB of baseline", abs(free1 - free0) <= TOL,
              mib(free1 - free0))


def section_c_producer(ctx: Ctx, rep: Report) -> None:
    size = ctx.size(4 * GiB)
    stride = ctx.stride(1 << 20)
    rep.h("(c2) A producer SIGKILLed while a consumer holds an import")
    rep.p(f"A fresh consumer reads its baseline before the producer exists. The producer "
          f"allocates {human(size)} float32 (3.0 every {stride} elements) and shares it; the "
          f"consumer opens it and checks it; the producer gets SIGKILL. The consumer checks "
          f"the data again through its mapping, closes it, and watches its "
          f"`torch.cuda.mem_get_info()`.")
    C = ctx.consumer()
    f0, _ = C.mem()
    P = ctx.producer()
    P.alloc(names=["x"], shape=[size // 4], dtype="float32", mark_stride=stride,
            mark_values=[3.0])
    sh = P.share(names=["x"])
    r1 = C.open(items=[{"name": "x", "b64": sh[0]["b64"]}], mark_stride=stride)
    expect_sums(rep, "consumer reads the share while the producer lives", r1, [3.0])
    f1, _ = C.mem()
    gone = P.kill(signal.SIGKILL)
    # The driver tears the dead producer's context down: wait until free memory settles.
    last = [C.mem()[0]]

    def settled():
        time.sleep(0.2)
        v = C.mem()[0]
        same = v == last[0]
        last[0] = v
        return same

    _, settle_s, _ = poll(settled, lambda ok: ok, 10, every=0)
    f2 = last[0]
    r2 = C.checksum(names=["x"], mark_stride=stride)
    same = r2[0]["marks"] == r1[0]["marks"] and r2[0]["total"] == r1[0]["total"]
    rep.check("consumer's mapping still correct after the producer died", same,
              f"marks {r2[0]['marks']} total {r2[0]['total']}")
    closed = C.close(names=["x"], how="explicit")
    C.empty_cache()
    (f3, _), secs, _ = poll(lambda: C.mem(), lambda v: abs(v[0] - f0) <= TOL, 10)
    C.exit()
    rep.table(["consumer free", "value", "vs baseline"], [
        ["baseline (no producer yet)", gb(f0), mib(0)],
        ["producer alive, share imported", gb(f1), mib(f1 - f0)],
        [f"producer killed (settled after {settle_s:.2f} s)", gb(f2), mib(f2 - f0)],
        [f"import closed (after {secs:.2f} s)", gb(f3), mib(f3 - f0)],
    ])
    rep.p(f"The producer's death released {mib(f2 - f1)} (its context and everything but the "
          f"shared memory, which the consumer's mapping kept: {human(size)}); closing the import "
          f"released {mib(f3 - f2)}. The producer was reaped {gone * 1e3:.1f} ms after SIGKILL.")
    rep.check("consumer closed its import of the dead producer", closed["imports_live"] == 0)
    if not ctx.sim:
        rep.check("the mapping held the shared memory until close",
                  f3 - f2 >= size - TOL, f"close released {mib(f3 - f2)}")
    rep.check("consumer's memory back to its baseline (within 2 MiB)", abs(f3 - f0) <= TOL,
              mib(f3 - f0))


# --------------------------------------------------------------------------------------
# (d) figures
# --------------------------------------------------------------------------------------


def section_d(ctx: Ctx, rep: Report) -> None:
    n = ctx.args.latency_n
    arena = ctx.size(1 * GiB)
    rep.h("(d) Figures: latency and exports")
    P = ctx.producer()
    C = ctx.consumer()
    names = [f"T{i}" for i in range(n)]
    P.alloc(names=names, shape=[arena // 4], dtype="float32", mark_stride=ctx.stride(1 << 20),
            mark_values=[1.0] * n)
    s0 = P.stats()
    first, again = [], []
    for name in names:
        s = P.share(names=[name])[0]
        r = C.open(items=[{"name": name, "b64": s["b64"]}])[0]
        first.append((s["dt"], r["dt"], r["t_end"] - s["t0"], s["arena"]))
    s1 = P.stats()
    for name in names:
        s = P.share(names=[name])[0]
        r = C.open(items=[{"name": name + "+", "b64": s["b64"]}])[0]
        again.append((s["dt"], r["dt"], r["t_end"] - s["t0"]))
    s2 = P.stats()
    C.close(names=names + [x + "+" for x in names])
    P.wait_imports_zero(timeout=5)
    P.unshare(names=names)
    P.free(names=names)
    P.empty_cache()

    def med(xs, i):
        return 1e3 * statistics.median(x[i] for x in xs)

    rep.p(f"Latency: {n} tensors of {human(arena)} (one arena each with fixed arenas, one arena "
          f"for all with growing ones); for each, the producer "
          f"shares it (first share of the arena: one driver export) and the consumer opens "
          f"it (first import of the arena: connect, fd over SCM_RIGHTS, import + map); then "
          f"each is shared again and opened again (the arena is exported and mapped already: "
          f"no driver call). End to end = from the producer's share() call to the consumer's "
          f"open() returning, including the relay of the bytes through this script's pipes. "
          f"Medians of {n}.")
    rep.table(["", "share() ms", "open() ms", "end to end ms", "driver exports"], [
        ["first share + first import of an arena", f"{med(first, 0):.3f}", f"{med(first, 1):.3f}",
         f"{med(first, 2):.3f}", s1["exports_total"] - s0["exports_total"]],
        ["another share of an arena already imported", f"{med(again, 0):.3f}",
         f"{med(again, 1):.3f}", f"{med(again, 2):.3f}", s2["exports_total"] - s1["exports_total"]],
    ])
    # Fixed arenas give each 1 GiB tensor an arena of its own; growing ones (the default) hold
    # them all in one arena, exported once (one fd per chunk).
    arenas = len({f[3] for f in first})
    rep.check("one export per arena, none for further shares",
              s1["exports_total"] - s0["exports_total"] == arenas
              and s2["exports_total"] == s1["exports_total"],
              f"{s1['exports_total'] - s0['exports_total']} + "
              f"{s2['exports_total'] - s1['exports_total']} exports for {2 * n} shares "
              f"of {n} tensors in {arenas} arena(s)")

    # A KV cache shared block by block.
    blocks, block = ctx.args.blocks, ctx.size(2 * MiB)
    a = P.blocks_alloc(count=blocks, nbytes=block, timeout=300)
    sh = P.blocks_share(timeout=300)
    imp = C.import_raw(handles=sh["handles"], timeout=300)
    cl = C.close_raw(timeout=300)
    P.wait_imports_zero(timeout=10)
    P.blocks_unshare_free(timeout=300)
    ec = P.empty_cache()
    C.exit()
    P.exit()
    share_total = sum(sh["times"])
    imp_total = sum(imp["times"])
    export_ms = med(first, 0) - med(again, 0)
    rep.p(f"A KV cache of {human(blocks * block)} as {blocks} blocks of {human(block)} "
          f"(`gpu_arena.malloc`, producer `{ctx.producer_conf}`), each block shared on its own "
          f"(`gpu_arena.share_ptr`) and imported on its own (`gpu_arena.import_handle`).")
    rep.table(["blocks", "arenas", "driver exports", "share all", "share median",
               "import all", "import median", "close all"], [[
                   blocks, sh["arenas_shared"], sh["exports_delta"],
                   f"{share_total * 1e3:.1f} ms",
                   f"{1e6 * statistics.median(sh['times']):.1f} us",
                   f"{imp_total * 1e3:.1f} ms",
                   f"{1e6 * statistics.median(imp['times']):.1f} us",
                   f"{cl['seconds'] * 1e3:.1f} ms"]])
    rep.p(f"Exporting per block instead would make {blocks} driver exports; at the export "
          f"cost measured above ({export_ms:.3f} ms = first share minus further share), that "
          f"is about {blocks * export_ms / 1e3:.1f} s, against {share_total:.2f} s here.")
    rep.check("KV blocks: driver exports == arenas", sh["exports_delta"] == sh["arenas_shared"]
              == a["arenas_new"], f"{sh['exports_delta']} exports, {sh['arenas_shared']} arenas "
              f"shared, {a['arenas_new']} arenas created, {blocks} blocks")
    rep.check("KV blocks: every block imported, then closed",
              imp["imports_live"] == blocks and cl["imports_live"] == 0)
    rep.check("KV blocks: everything released", ec["reserved"] == 0, f"reserved {ec['reserved']}")


# --------------------------------------------------------------------------------------


SECTIONS = {
    "a": section_a,
    "naive": section_a_naive,
    "b": section_b,
    "c1": section_c_consumer,
    "c2": section_c_producer,
    "d": section_d,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim", action="store_true",
                    help="sim backend, no torch, no GPU, sizes / 1024 (tests the plumbing)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections (default all: {','.join(SECTIONS)})")
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--latency-n", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=8192)
    args = ap.parse_args()

    ctx = Ctx(args.sim, args)
    rep = Report()
    t_start = time.monotonic()
    which = [s.strip() for s in args.only.split(",") if s.strip()]
    for name in which:
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}")
    try:
        for name in which:
            t0 = time.monotonic()
            try:
                SECTIONS[name](ctx, rep)
            except Exception as e:  # noqa: BLE001 - a section's failure is a failed check
                rep.p(f"**Section {name} failed:**")
                rep.code(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
                rep.check(f"section {name} ran to the end", False, f"{type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}")
            finally:
                Worker.kill_all()
            rep.p(f"_(section {name}: {time.monotonic() - t0:.1f} s)_")
    finally:
        Worker.kill_all()
        header = ["# gpu-arena IPC check", ""]
        header.append(f"mode: {'sim (plumbing only: sizes / 1024, no GPU figures)' if ctx.sim else 'cuda + torch'}; "
                      f"producers `{ctx.producer_conf}`, consumers `{ctx.consumer_conf}`; "
                      f"sections: {', '.join(which)}; {time.monotonic() - t_start:.0f} s; "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        try:
            import gpu_arena  # noqa: F401  (only for the path of the library)

            header.append(f"library: {gpu_arena.lib_path()}")
        except Exception as e:  # noqa: BLE001
            header.append(f"library: not found ({e})")
        i = Worker.first_info
        header.append(f"python {sys.version.split()[0]}" + (
            f"; torch {i.get('torch')} (CUDA {i.get('cuda')}); device: {i.get('device')}"
            if "torch" in i else ""))
        text = rep.render(header)
        print(text)
        out = os.environ.get("OUT")
        if out:
            try:
                os.makedirs(out, exist_ok=True)
                with open(os.path.join(out, "ipc_report.md"), "w") as f:
                    f.write(text)
            except OSError as e:
                log(f"could not write $OUT/ipc_report.md: {e}")
    return 1 if rep.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
