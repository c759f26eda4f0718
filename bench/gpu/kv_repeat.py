#!/usr/bin/env python3
"""The KV trace replay, gpu-arena against PyTorch's caching allocator, repeated.

One kv_bench run (bench/gpu/run.sh) is one process on a shared machine: on the lent H200s
its absolute times moved by up to 2x from one process to the next, for both allocators.
This runs kv_bench N times (each a fresh process replaying the same seeded trace, gpu-arena
then PyTorch, cold then warm, pair latency included), each pinned to one CPU, and reports
every run's ratio and the median, smallest and largest ratio: the figure to quote is the
median, the spread says how far one run can be trusted. Each run also replays the trace with
both allocators in one loop, taking turns every N ops (`--interleave N`, kv_bench's
interleaved replay): the machine's speed changes within a second, and there a change slows
both alike.

    python3 bench/gpu/kv_repeat.py [--runs 7] [--cpu 2] [--trace .gpu/kv_trace.bin] [--interleave 4096]
        [--arena-conf backend=cuda,grow_arenas=1]

Builds .gpu/kv_bench with bench/gpu/build.sh when missing; needs .gpu/libgpu_arena.so. Writes the report
to stdout and, when OUT is set, to $OUT/kv_repeat.md with each run's kv_bench report beside
it. Exit status 1 when a run fails or an allocator reports failures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from gpu_common import ROOT, out_path  # noqa: E402  (tests/gpu/gpu_common.py)

ROWS = {"gpu-arena": "gpu-arena (C API", "torch": "PyTorch CUDACachingAllocator"}


def ns(cell: str) -> float:
    """'89.9 ns' or '1.2 µs' as nanoseconds."""
    m = re.match(r"\s*([0-9.]+)\s*(ns|µs|us|ms)", cell)
    if not m:
        raise ValueError(f"not a time: {cell!r}")
    scale = {"ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6}[m.group(2)]
    return float(m.group(1)) * scale


def parse(report: str) -> dict[str, dict[str, float]]:
    """Cold/warm ns per op and reserved/live from the replay table, cold/warm ns per op of
    the interleaved replay ("il_cold", "il_warm"), pair ns from the pair table, per
    allocator."""
    out: dict[str, dict[str, float]] = {k: {} for k in ROWS}
    section = "replay"
    for line in report.splitlines():
        if line.startswith("## Warm alloc+free pair"):
            section = "pairs"
        elif line.startswith("## Interleaved replay"):
            section = "interleaved"
        elif line.startswith("## "):
            section = "other"
        if section == "other":
            continue
        for key, prefix in ROWS.items():
            if not line.startswith("| " + prefix):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if section == "pairs":
                out[key]["pair"] = ns(cells[1])
            elif section == "interleaved":
                out[key]["il_cold"] = ns(cells[1])
                out[key]["il_warm"] = ns(cells[2])
                out[key]["il_failures"] = 0.0 if cells[3] == "0" else 1.0
            else:
                out[key]["cold"] = ns(cells[1])
                out[key]["warm"] = ns(cells[2])
                out[key]["reserved_live"] = float(cells[4])
                out[key]["failures"] = 0.0 if cells[-1] in ("0", "") else 1.0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cpu", type=int, default=2, help="CPU to pin each run to (-1: none)")
    ap.add_argument("--trace", default=str(ROOT / ".gpu/kv_trace.bin"))
    ap.add_argument("--interleave", type=int, default=4096,
                    help="ops per turn of kv_bench's interleaved replay (0: not run)")
    ap.add_argument("--arena-conf", help="gpu-arena's configuration string for kv_bench")
    args = ap.parse_args()
    out_dir = Path(out_path())
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("GPU_ARENA_LIB", str(ROOT / ".gpu/libgpu_arena.so"))
    bench = str(ROOT / ".gpu/kv_bench")
    if not Path(bench).exists():
        b = subprocess.run(["bash", str(ROOT / "bench/gpu/build.sh"), bench],
                           env={**env, "KV_BENCH_REQUIRE_TORCH": "1"})
        if b.returncode != 0 or not Path(bench).exists():
            print(f"{bench} missing and bench/gpu/build.sh failed", file=sys.stderr)
            return 1
    pin = ["taskset", "-c", str(args.cpu)] if args.cpu >= 0 and shutil.which("taskset") else []
    runs = []
    ok = True
    for i in range(1, args.runs + 1):
        md = out_dir / f"kv_repeat_{i}.md"
        cmd = pin + [bench, "--trace", args.trace, "--out", str(md), "--skip", "cumemalloc,async",
                     "--pair-bytes", str(2 << 20), "--no-scaling", "--interleave", str(args.interleave)]
        if args.arena_conf:
            cmd += ["--arena-conf", args.arena_conf]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0 or not md.exists():
            print(f"run {i}: kv_bench exited {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
            ok = False
            continue
        r = parse(md.read_text())
        want = 8 if args.interleave > 0 else 5
        if (any(r[k].get("failures", 1.0) or r[k].get("il_failures", 0.0) for k in ROWS)
                or any(len(r[k]) < want for k in ROWS)):
            print(f"run {i}: failures or missing rows in {md}", file=sys.stderr)
            ok = False
        runs.append(r)
        print(f"run {i}: " + ", ".join(
            f"{k} cold {r[k].get('cold', 0):.0f} warm {r[k].get('warm', 0):.0f} pair {r[k].get('pair', 0):.0f} ns"
            for k in ROWS), flush=True)
    if not runs:
        return 1

    il = args.interleave > 0

    def ratios(metric: str) -> list[float]:
        return [r["torch"][metric] / r["gpu-arena"][metric] for r in runs
                if r["gpu-arena"].get(metric) and r["torch"].get(metric)]

    lines = [
        "# KV trace replay, gpu-arena vs PyTorch, repeated",
        "",
        f"{len(runs)} runs of `{' '.join(pin + ['.gpu/kv_bench', '--trace', args.trace, '--skip', 'cumemalloc,async', '--no-scaling', '--interleave', str(args.interleave)])}`, "
        "each a fresh process: the same seeded trace, gpu-arena (C API, cuda backend) then "
        "PyTorch's caching allocator, each cold then warm (sequential)"
        + (f"; then both in one loop, taking turns every {args.interleave} ops, cold then warm "
           "(interleaved: a change of the machine's speed slows both alike)" if il else "")
        + "; then 2 MiB alloc+free pairs on one thread. Speedup = PyTorch ns/op / gpu-arena "
        "ns/op within one run.",
        "",
        "| run | gpu-arena cold | warm | pair | PyTorch cold | warm | pair | speedup cold | warm | pair | reserved/live gpu-arena | PyTorch |"
        + (" interleaved gpu-arena cold | warm | PyTorch cold | warm | speedup cold | warm |" if il else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 6 if il else ""),
    ]
    for i, r in enumerate(runs, 1):
        g, t = r["gpu-arena"], r["torch"]
        lines.append(
            f"| {i} | {g['cold']:.0f} ns | {g['warm']:.0f} ns | {g['pair']:.0f} ns | "
            f"{t['cold']:.0f} ns | {t['warm']:.0f} ns | {t['pair']:.0f} ns | "
            f"{t['cold'] / g['cold']:.2f}x | {t['warm'] / g['warm']:.2f}x | {t['pair'] / g['pair']:.2f}x | "
            f"{g['reserved_live']:.3f} | {t['reserved_live']:.3f} |"
            + (f" {g['il_cold']:.0f} ns | {g['il_warm']:.0f} ns | {t['il_cold']:.0f} ns | {t['il_warm']:.0f} ns | "
               f"{t['il_cold'] / g['il_cold']:.2f}x | {t['il_warm'] / g['il_warm']:.2f}x |" if il else ""))
    lines += ["", "| speedup | median | smallest | largest |", "|---|---:|---:|---:|"]
    names = {"cold": "cold", "warm": "warm", "pair": "pair", "il_cold": "interleaved cold",
             "il_warm": "interleaved warm"}
    for metric in ("cold", "warm", "pair") + (("il_cold", "il_warm") if il else ()):
        rs = ratios(metric)
        if rs:
            lines.append(f"| {names[metric]} | {statistics.median(rs):.2f}x | {min(rs):.2f}x | {max(rs):.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out_dir / "kv_repeat.md").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
