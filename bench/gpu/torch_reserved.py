#!/usr/bin/env python3
"""Peak reserved memory against peak requested bytes: PyTorch's caching allocator, PyTorch with
``expandable_segments:True`` and gpu-arena (``install(route="native")``), on training and
generation loops of transformer encoders; on the GPU machine:

    GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONPATH=$PWD/python \\
        python3 bench/gpu/torch_reserved.py --out $OUT/reserved.md --trace-dir $OUT/traces

Each (workload, mode) is a fresh process, the modes of a workload back to back: ``torch``
(PYTORCH_CUDA_ALLOC_CONF unset), ``torch-expandable`` (PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True in the child's environment) and ``gpu-arena`` (``gpu_arena.torch.
install(route="native")`` before any CUDA use, so torch.cuda.memory_stats() is gpu-arena's:
its default, arenas that grow; ``gpu-arena-grow``: the same with ``GPU_ARENA_CONF=grow_arenas=1``
said explicitly (as the results before growth became the default were taken);
``gpu-arena-fixed``: ``GPU_ARENA_CONF=grow_arenas=0``, fixed 1 GiB arenas).
Every model is a ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer(d, heads, 4*d,
dropout=0.0, batch_first=True)``, fp32 parameters made on the GPU, seed 0, run under
``torch.autocast("cuda", dtype=torch.bfloat16)``:

* ``*_train``: AdamW, loss ``out.float().pow(2).mean()``, backward, step, zero_grad(None):
  small d512 8 heads 4 layers, batch 8 x 512, 6 steps; medium d2048 16 heads 12 layers,
  8 x 1024, 4 steps; large d4096 32 heads 16 layers, 4 x 1024, 3 steps.
* ``*_generate``: eval, no_grad, a few forward passes per batch size, sequence lengths cycling
  across batches. small (d512): batches 1..16, lengths 128..1024, 4 passes each. medium
  (d2048, 12 layers) and large (d4096, 16 layers): batches 1..64, lengths 256..2048, 3 passes
  each, serving-shaped: each pass first allocates a bf16 (batch, length, d) K and V per layer,
  then runs the prefill, then 4 one-token "decode" passes that each add a (batch, 1, d) K and V
  per layer; the batch's whole cache is kept until its last pass, then dropped.

Measured from the process start (model creation included): memory_stats()'s
``reserved_bytes.all.peak``, ``requested_bytes.all.peak`` (``allocated_bytes.all.peak`` where
missing or 0; the report says which), ``allocated_bytes.all.peak``, ``segment.all.peak`` (for
gpu-arena the arenas held at the end: it keeps no peak of counts; 0 with expandable segments)
and ``num_alloc_retries``; the largest drop of free device memory (``torch.cuda.mem_get_info()``)
below its reading right after CUDA init, sampled after model creation and after every step or
pass; the loop's wall time. An out-of-memory error ends the loop and is reported with the figures reached.

``--trace-dir DIR`` also runs each workload once more in each mode of ``--trace-modes``
(default ``torch``) with
``torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)`` from the
start (no stacks: only the trace), and writes device 0's alloc / free_completed events as
``DIR/<workload>.trace.gz`` (mode torch; ``DIR/<workload>.<mode>.trace.gz`` for another),
gzip text: a header ``# gpu-arena torch trace v1 workload=<name> mode=<mode> torch=<version>``, then ``a <id> <size> <stream>`` or ``f <id>`` per event (id: a new one per
allocation; size: the bytes requested; stream: index of its stream in order of appearance).
Frees of allocations made before the recording (or lost off the ring buffer) are skipped and
counted in ``DIR/<workload>.trace.json`` (with the event counts and the peak live bytes).

Options: ``--workloads a,b`` and ``--modes a,b`` pick subsets, ``--scale F`` multiplies batch
sizes (a quick dry run), ``--timeout S`` bounds each child (default 1200 s), ``--self-test``
checks the trace encoder and the options without a GPU or torch. The markdown (``--out``,
default $OUT/torch_reserved.md) gets a table of peak reserved MiB (reserved / requested) per
workload and mode, and the figures of each run; FILE.json has all results. Exit 1 when a run
failed or ran out of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from gpu_common import child_env, out_path  # noqa: E402  (tests/gpu/gpu_common.py)
from result_channel import NO_RESULT, report, run_reporting  # noqa: E402  (tests/python: a child's own channel)

MIB = 1 << 20
MODES = ("torch", "torch-expandable", "gpu-arena", "gpu-arena-grow", "gpu-arena-fixed")
TRACE_MAX_ENTRIES = 2_000_000
DECODE_STEPS = 4  # one-token passes after each prefill of a workload with a KV cache


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    d: int
    heads: int
    layers: int
    train: bool
    batches: tuple  # train: the one batch size
    seqs: tuple  # train: the one sequence length; generate: the cycle
    steps: int  # train: optimizer steps; generate: passes per batch size
    kv_cache: bool = False


SERVING_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WORKLOADS = {w.name: w for w in (
    Workload("small_train", 512, 8, 4, True, (8,), (512,), 6),
    Workload("small_generate", 512, 8, 4, False, (1, 2, 4, 8, 16), (128, 256, 512, 1024), 4),
    Workload("medium_train", 2048, 16, 12, True, (8,), (1024,), 4),
    Workload("medium_generate", 2048, 16, 12, False, SERVING_BATCHES, (256, 512, 1024, 2048), 3, True),
    Workload("large_train", 4096, 32, 16, True, (4,), (1024,), 3),
    Workload("large_generate", 4096, 32, 16, False, SERVING_BATCHES, (256, 512, 1024, 2048), 3, True),
)}


def scaled(w: Workload, scale: float) -> Workload:
    return dataclasses.replace(w, batches=tuple(max(1, round(b * scale)) for b in w.batches))


# --- the trace ----------------------------------------------------------------------------


def encode_trace(events, out) -> dict:
    """Write the alloc / free_completed events of one device's trace (dicts with action, addr,
    size, stream) to `out` as ``a <id> <size> <stream>`` / ``f <id>`` lines; return the counts
    and the peak live bytes. A free of an address not live in the trace is skipped and counted;
    an allocation at a live address raises ValueError (the trace would be inconsistent)."""
    live: dict = {}  # addr -> (id, size)
    streams: dict = {}
    allocs = frees = skipped = live_bytes = peak = 0
    for e in events:
        action, addr = e["action"], e["addr"]
        if action == "alloc":
            if addr in live:
                raise ValueError(f"allocation at live address {addr:#x} (id {live[addr][0]})")
            stream = streams.setdefault(e["stream"], len(streams))
            live[addr] = (allocs, e["size"])
            out.write(f"a {allocs} {e['size']} {stream}\n")
            allocs += 1
            live_bytes += e["size"]
            peak = max(peak, live_bytes)
        elif action == "free_completed":
            if addr not in live:
                skipped += 1
                continue
            ident, size = live.pop(addr)
            out.write(f"f {ident}\n")
            frees += 1
            live_bytes -= size
    return {"events": allocs + frees, "allocs": allocs, "frees": frees,
            "skipped_frees": skipped, "live_at_end": len(live), "live_bytes_at_end": live_bytes,
            "peak_live_bytes": peak, "streams": len(streams)}


def trace_name(workload: str, mode: str) -> str:
    """The trace file's stem: the workload's name for mode torch, else workload.mode."""
    return workload if mode == "torch" else f"{workload}.{mode}"


def write_trace(trace_dir: str, workload: str, torch_version: str, events, mode: str = "torch") -> dict:
    """DIR/<stem>.trace.gz and DIR/<stem>.trace.json (`trace_name`); returns the summary."""
    stem = trace_name(workload, mode)
    base = Path(trace_dir) / stem
    with gzip.open(f"{base}.trace.gz", "wt") as f:
        f.write(f"# gpu-arena torch trace v1 workload={workload} mode={mode} torch={torch_version}\n")
        summary = encode_trace(events, f)
    summary.update(workload=workload, torch=torch_version, recorded_entries=len(events),
                   truncated=len(events) >= TRACE_MAX_ENTRIES, file=f"{stem}.trace.gz", mode=mode)
    Path(f"{base}.trace.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# --- the child ----------------------------------------------------------------------------


def run_loop(torch, w: Workload, sample) -> float:
    """Build the model, run the workload's loop; the loop's wall time in seconds."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(w.d, w.heads, 4 * w.d, dropout=0.0, batch_first=True,
                                             device="cuda")
    model = torch.nn.TransformerEncoder(layer, w.layers, enable_nested_tensor=False)
    del layer
    sample()
    bf16 = torch.bfloat16
    t0 = time.perf_counter()
    if w.train:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(w.batches[0], w.seqs[0], w.d, device="cuda")
        for _ in range(w.steps):
            with torch.autocast("cuda", dtype=bf16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sample()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    model.eval()

    def forward(batch: int, seq: int, cache: list) -> None:
        if w.kv_cache:
            cache.extend(torch.empty(batch, seq, w.d, dtype=bf16, device="cuda")
                         for _ in range(2 * w.layers))
        model(torch.randn(batch, seq, w.d, dtype=bf16, device="cuda"))
        sample()

    passes = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=bf16):
        for batch in w.batches:
            cache: list = []
            for _ in range(w.steps):
                forward(batch, w.seqs[passes % len(w.seqs)], cache)
                passes += 1
                for _ in range(DECODE_STEPS if w.kv_cache else 0):
                    forward(batch, 1, cache)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def child(mode: str, w: Workload, trace_dir) -> dict:
    if mode.startswith("gpu-arena"):
        import gpu_arena.torch as gt

        gt.install(route="native")
    import torch

    if trace_dir:
        torch.cuda.memory._record_memory_history(enabled="all", context=None,
                                                 max_entries=TRACE_MAX_ENTRIES)
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    max_drop = 0

    def sample() -> None:
        nonlocal max_drop
        max_drop = max(max_drop, free0 - torch.cuda.mem_get_info()[0])

    res = {"workload": w.name, "mode": mode, "batches": list(w.batches), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "total_bytes": total}
    if mode.startswith("gpu-arena"):
        res["route"] = gt.route_in_use()
    try:
        res["loop_s"] = run_loop(torch, w, sample)
    except torch.cuda.OutOfMemoryError as e:
        res["oom"] = str(e).splitlines()[0]
    sample()
    st = torch.cuda.memory_stats()
    source = "requested_bytes.all.peak"
    if not st.get(source):
        source = "allocated_bytes.all.peak"
    res.update(requested_peak=st[source], requested_source=source,
               allocated_peak=st["allocated_bytes.all.peak"],
               reserved_peak=st["reserved_bytes.all.peak"],
               ratio=st["reserved_bytes.all.peak"] / st[source] if st[source] else None,
               max_free_drop=max_drop, segments_peak=st.get("segment.all.peak"),
               alloc_retries=st.get("num_alloc_retries"))
    if trace_dir:
        events = torch.cuda.memory._snapshot()["device_traces"][0]
        res["trace"] = write_trace(trace_dir, w.name, torch.__version__, events, mode)
    return res


# --- the parent ---------------------------------------------------------------------------


def run(mode: str, workload: str, a, trace: bool = False) -> dict:
    env = child_env()
    if mode == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode == "gpu-arena-grow":
        env["GPU_ARENA_CONF"] = "grow_arenas=1"
    if mode == "gpu-arena-fixed":
        env["GPU_ARENA_CONF"] = "grow_arenas=0"
    cmd = [sys.executable, __file__, "--child", mode, "--workloads", workload, "--scale", str(a.scale)]
    if trace:
        cmd += ["--trace-dir", a.trace_dir]
    failed = {"workload": workload, "mode": mode}
    try:
        res, p = run_reporting(cmd, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {a.timeout} s"}
    if res is NO_RESULT:
        last = (p.stderr.strip().splitlines() or [""])[-1]
        return {**failed, "error": f"no result (rc={p.returncode}): {last}", "stderr_tail": p.stderr[-3000:]}
    return res


def log(label: str, r: dict) -> dict:
    """Print a run's result to stderr (a failed child's stderr as it was); return it."""
    print(f"{label}: {json.dumps({k: v for k, v in r.items() if k != 'stderr_tail'})}", file=sys.stderr)
    if "stderr_tail" in r:
        print(r["stderr_tail"], file=sys.stderr)
    sys.stderr.flush()
    return r


def mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def ratio(r: dict) -> str:
    return "-" if r["ratio"] is None else f"{r['ratio']:.3f}"


def cell(r: dict) -> str:
    if "error" in r:
        return "failed"
    return f"{mib(r['reserved_peak'])} ({ratio(r)})" + (" OOM" if "oom" in r else "")


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def markdown(a, workloads, modes, runs: dict, traces: list) -> tuple:
    first = next((r for r in runs.values() if "torch" in r), {})
    head = f"| workload | {' | '.join(modes)} |\n|---|{'---|' * len(modes)}"
    short = "\n".join([head] + [f"| {w} | {' | '.join(cell(runs[w, m]) for m in modes)} |"
                                for w in workloads])
    lines = ["# Peak reserved vs peak requested: torch, expandable segments, gpu-arena "
             "(bench/gpu/torch_reserved.py)", "",
             f"torch {first.get('torch', '?')}, {first.get('device', '?')}, batch scale {a.scale}. "
             "Each run a fresh process, measured from its start (model creation included). "
             "Cells: peak reserved MiB (peak reserved / peak requested).", "", short, "",
             "## Per run", "",
             "| workload | mode | requested peak MiB | allocated peak MiB | reserved peak MiB | "
             "reserved / requested | max free drop MiB | segments peak | alloc retries | loop s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (w, m), r in runs.items():
        if "error" in r:
            lines.append(row(w, m, f"failed: {first_line(r['error'])}", *[""] * 7))
            continue
        star = "" if r["requested_source"] == "requested_bytes.all.peak" else " (allocated)"
        loop = f"{r['loop_s']:.2f}" if "loop_s" in r else f"OOM: {r['oom'][:120]}"
        lines.append(row(w, m, mib(r["requested_peak"]) + star, mib(r["allocated_peak"]),
                         mib(r["reserved_peak"]), ratio(r), mib(r["max_free_drop"]),
                         r["segments_peak"], r["alloc_retries"], loop))
    if traces:
        lines += ["", "## Traces (recorded in a run of their own)", "",
                  "| workload | mode | file | events | peak live MiB | skipped frees | live at end | streams | truncated |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in traces:
            if "error" in t:
                lines.append(row(t["workload"], t["mode"], f"failed: {first_line(t['error'])}", *[""] * 6))
                continue
            s = t["trace"]
            lines.append(row(t["workload"], t["mode"], s["file"], s["events"], mib(s["peak_live_bytes"]),
                             s["skipped_frees"], s["live_at_end"], s["streams"], s["truncated"]))
    return "\n".join(lines) + "\n", short


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out_path("torch_reserved.md"),
                    help="markdown report, FILE.json beside it (default $OUT/torch_reserved.md)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the batch sizes")
    ap.add_argument("--trace-dir", help="also record each workload's allocation trace")
    ap.add_argument("--trace-modes", default="torch",
                    help="comma-separated modes whose traces --trace-dir records (default torch)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per child")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--self-test", action="store_true", help="check the trace encoder, no GPU")
    a = ap.parse_args(argv)
    a.workloads, a.modes = a.workloads.split(","), a.modes.split(",")
    a.trace_modes = a.trace_modes.split(",")
    for name, given, known in (("workload", a.workloads, WORKLOADS), ("mode", a.modes, MODES),
                               ("trace mode", a.trace_modes, MODES)):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"unknown {name}(s) {unknown}; known: {', '.join(known)}")
    if a.scale <= 0:
        ap.error("--scale must be > 0")
    return a


def self_test() -> None:
    def ev(action, addr, size=0, stream=0):
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [ev("free_completed", 0x900, 64),  # allocated before the recording: skipped
              ev("segment_alloc", 0x1000, 2 * MIB), ev("alloc", 0x1000, 512),
              ev("alloc", 0x1200, 1000, 77), ev("free_requested", 0x1000, 512),
              ev("free_completed", 0x1000, 512), ev("alloc", 0x1000, 256, 77),  # reused: new id
              ev("free_requested", 0x1200, 1000), ev("free_completed", 0x1200, 1000)]
    out = io.StringIO()
    s = encode_trace(events, out)
    assert out.getvalue() == "a 0 512 0\na 1 1000 1\nf 0\na 2 256 1\nf 1\n", out.getvalue()
    assert (s["events"], s["allocs"], s["frees"], s["skipped_frees"]) == (5, 3, 2, 1), s
    assert (s["peak_live_bytes"], s["live_at_end"], s["live_bytes_at_end"]) == (1512, 1, 256), s
    assert s["streams"] == 2, s
    try:
        encode_trace([ev("alloc", 0x10, 8), ev("alloc", 0x10, 8)], io.StringIO())
        raise AssertionError("an allocation at a live address was accepted")
    except ValueError:
        pass
    with tempfile.TemporaryDirectory() as d:
        s = write_trace(d, "fake", "0.0", events)
        with gzip.open(Path(d) / "fake.trace.gz", "rt") as f:
            text = f.read().splitlines()
        assert text[0] == "# gpu-arena torch trace v1 workload=fake mode=torch torch=0.0" and len(text) == 6, text
        assert json.loads((Path(d) / "fake.trace.json").read_text())["peak_live_bytes"] == 1512
        assert s["recorded_entries"] == len(events) and not s["truncated"], s
        write_trace(d, "fake", "0.0", events, "torch-expandable")
        assert (Path(d) / "fake.torch-expandable.trace.gz").exists()
    a = parse_args(["--workloads", "small_train,medium_generate", "--modes", "gpu-arena", "--scale", "0.1",
                    "--trace-modes", "torch,gpu-arena-grow"])
    assert a.workloads == ["small_train", "medium_generate"] and a.modes == ["gpu-arena"], a
    assert a.trace_modes == ["torch", "gpu-arena-grow"], a
    assert scaled(WORKLOADS["medium_generate"], 0.1).batches[:3] == (1, 1, 1), "scale keeps batches >= 1"
    assert scaled(WORKLOADS["medium_generate"], 0.1).batches[-1] == 6
    print("self-test ok")


def main() -> int:
    a = parse_args()
    if a.self_test:
        self_test()
        return 0
    if a.child:
        report(child(a.child, scaled(WORKLOADS[a.workloads[0]], a.scale), a.trace_dir))
        return 0
    if a.trace_dir:
        Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    traces: list = []
    for w in a.workloads:
        for m in a.modes:
            runs[w, m] = log(f"{w} {m}", run(m, w, a))
        for m in a.trace_modes if a.trace_dir else []:
            traces.append(log(f"{w} trace {m}", run(m, w, a, trace=True)))
    md, short = markdown(a, a.workloads, a.modes, runs, traces)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(md)
    Path(a.out).with_suffix(".json").write_text(
        json.dumps({"runs": list(runs.values()), "traces": traces}, indent=1) + "\n")
    print(short)
    bad = [r for r in [*runs.values(), *traces] if "error" in r or "oom" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
