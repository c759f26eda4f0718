#!/usr/bin/env python3
"""A real training loop under gpu-arena with its allocation history on; the snapshot goes
through PyTorch's own viewer code. Run on the GPU machine:

    GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONPATH=$PWD/python \\
        python3 tests/gpu/gpu_memory_viz.py --out gpu-out/memviz

Writes into ``--out``:

* ``snapshot.pickle``: ``gpu_arena.torch.dump_snapshot`` after a 2-layer transformer (bf16
  autocast, AdamW) trained for a few steps under ``gpu_arena.torch.install()``, history on
  with ``stacks="python"`` and ``annotate()`` regions (forward / backward / optimizer);
* ``trace_plot.html`` (``python -m torch.cuda._memory_viz trace_plot``; it loads its
  JavaScript from the internet: render it offline with ``scripts/render-memory-viz.sh``),
  ``stats.txt`` (``… stats``), ``trace.txt`` (``… trace``, first 200 lines);
* ``memviz.md``: the checks (our ``check_snapshot``, PyTorch's ``_memory_viz`` subcommands'
  exit codes, event counts, memory_stats vs mem_get_info) and the memory_summary.

Then on the dev machine: ``scripts/render-memory-viz.sh gpu-out/memviz/snapshot.pickle``.
Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path

from gpu_common import out_path  # beside this file


def train(torch, gt, steps: int) -> list:
    torch.manual_seed(0)
    d, heads, seq, batch = 512, 8, 256, 16
    layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                             norm_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(d, d)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(steps):
        with gt.annotate("data"):
            x = torch.randn(batch, seq, d, device="cuda")
            target = torch.randn(batch, seq, d, device="cuda")
        with gt.annotate("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        with gt.annotate("backward"):
            loss.backward()
        with gt.annotate("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=out_path("memviz"))
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import gpu_arena
    import gpu_arena.torch as gt
    from gpu_arena.torch_snapshot import check_snapshot

    gt.install()
    import torch

    free0, total = torch.cuda.mem_get_info()
    gt.record_memory_history(max_entries=200_000, stacks="python")
    losses = train(torch, gt, a.steps)
    torch.cuda.synchronize()
    snap_path = out / "snapshot.pickle"
    snap = gt.dump_snapshot(str(snap_path))
    gt.record_memory_history(False)
    free1, _ = torch.cuda.mem_get_info()
    stats = gt.memory_stats()

    checks = {}
    problems = check_snapshot(snap)
    checks["check_snapshot: no problems"] = not problems
    trace = snap["device_traces"][0] if snap["device_traces"] else []
    actions = collections.Counter(t["action"] for t in trace)
    checks["trace has alloc, free_completed, segment_alloc"] = all(
        actions[k] > 0 for k in ("alloc", "free_completed", "segment_alloc"))
    labels = collections.Counter(t["user_metadata"] for t in trace)
    checks["forward events labelled"] = labels["forward"] > 0
    checks["loss finite"] = all(x == x for x in losses)
    used = free0 - free1
    # The drop also holds what CUDA loads lazily (kernels, cuBLAS): a loose bound.
    checks["reserved within 512 MiB of the drop in free memory"] = (
        abs(stats["reserved_bytes.all.current"] - used) <= 512 << 20)

    viz = [sys.executable, "-m", "torch.cuda._memory_viz"]
    runs = {
        "trace_plot": viz + ["trace_plot", str(snap_path), "-o", str(out / "trace_plot.html")],
        "segment_plot": viz + ["segment_plot", str(snap_path), "-o", str(out / "segment_plot.html")],
        "stats": viz + ["stats", str(snap_path)],
        "trace": viz + ["trace", str(snap_path)],
    }
    rcs = {}
    for name, cmd in runs.items():
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rcs[name] = p.returncode
        if name in ("stats", "trace"):
            text = p.stdout if name == "stats" else "\n".join(p.stdout.splitlines()[:200])
            (out / f"{name}.txt").write_text(text + ("\n--- stderr\n" + p.stderr if p.stderr else ""))
        checks[f"_memory_viz {name}: exit 0"] = p.returncode == 0
        if p.returncode != 0:
            print(f"{name} failed:\n{p.stderr[-2000:]}", file=sys.stderr)

    md = ["# gpu-arena snapshot through PyTorch's _memory_viz (tests/gpu/gpu_memory_viz.py)", "",
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}, gpu-arena backend "
          f"{gpu_arena.backend_name()}, OOM route {gt.oom_route()}, {a.steps} steps, "
          f"losses {losses[0]:.4f} -> {losses[-1]:.4f}", "",
          "| check | result |", "|---|---|"]
    md += [f"| {k} | {'PASS' if v else 'FAIL'} |" for k, v in checks.items()]
    md += ["", f"Events: {dict(actions)}; labels: {dict(labels)}; "
           f"segments: {len(snap['segments'])}; snapshot problems: {problems[:5]}", "",
           f"Memory: reserved {stats['reserved_bytes.all.current']} B, allocated "
           f"{stats['allocated_bytes.all.current']} B (peak {stats['allocated_bytes.all.peak']} B), "
           f"drop in free device memory since install {used} B of {total} B", "",
           "```", gt.memory_summary(), "```", ""]
    (out / "memviz.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
