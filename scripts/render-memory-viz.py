#!/usr/bin/env python3
"""Render a memory snapshot pickle (``gpu_arena.torch.dump_snapshot``, or PyTorch's own) to
PNG with PyTorch's MemoryViz.js, offline, on a development machine.

PyTorch's ``trace_plot`` HTML loads MemoryViz.js from jsdelivr and d3 from skypack, so it
renders nothing without internet. This script builds one self-contained HTML per view
instead (d3@5's UMD bundle inlined, then MemoryViz.js inlined as a module with its five CDN
``import`` lines replaced by ``const {...} = d3``, then ``add_local_files`` with the pickle
as base64) and screenshots it with headless Chromium.

Needs:
* a copy of MemoryViz.js (BSD-3, PyTorch's; not in the wheel, not committed here):
  ``--memoryviz`` or ``$MEMORYVIZ_JS``, default ``/work/notes/MemoryViz.js``;
* d3@5's ``dist/d3.min.js``: ``--d3``, else ``npm pack d3@5`` once into
  ``~/.cache/gpu_arena/d3@5/``;
* Chromium (``apt-get install -y chromium``): ``--chromium`` or on PATH.

Usage:
    scripts/render-memory-viz.py gpu-out/memviz/snapshot.pickle        # -> <pickle>-<view>.png
    scripts/render-memory-viz.py --demo /tmp/memviz-demo               # sim snapshot, then render
Views: timeline (Active Memory Timeline), state (Allocator State History), segments (Active
Cached Segment Timeline); ``--views timeline,state`` picks. The HTML files are kept beside
the PNGs (open them in a browser: they work offline and are interactive).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VIEWS = {
    "timeline": "Active Memory Timeline",
    "state": "Allocator State History",
    "segments": "Active Cached Segment Timeline",
}
IMPORT_RE = re.compile(r'^import .* from "https://cdn\.skypack\.dev/[^"]+";\n', re.M)


def d3_bundle(given: str | None) -> str:
    if given:
        return Path(given).read_text()
    cache = Path(os.environ.get("GPU_ARENA_CACHE", Path.home() / ".cache" / "gpu_arena")) / "d3@5"
    js = cache / "d3.min.js"
    if not js.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", "d3@5", "--silent"], cwd=tmp, check=True,
                           capture_output=True)
            tgz = next(Path(tmp).glob("d3-5*.tgz"))
            with tarfile.open(tgz) as t:
                member = t.extractfile("package/dist/d3.min.js")
                if member is None:
                    raise SystemExit(f"{tgz} has no package/dist/d3.min.js")
                js.write_bytes(member.read())
    return js.read_text()


def memoryviz_module(path: str) -> str:
    src = Path(path).read_text()
    src, n = IMPORT_RE.subn("", src)
    if n != 5:
        raise SystemExit(f"{path}: expected 5 skypack import lines, found {n} (another version?)")
    return "const {axisLeft, scaleLinear, zoom, zoomIdentity, brushX} = d3;\n" + src


def html(pickle_bytes: bytes, name: str, view: str, d3: str, viz: str) -> str:
    b64 = base64.b64encode(pickle_bytes).decode()
    # "</script" must not appear inside the inlined scripts.
    d3 = d3.replace("</script", "<\\/script")
    viz = viz.replace("</script", "<\\/script")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" + name + "</title></head>\n"
        "<body>\n<script>" + d3 + "</script>\n<script type='module'>\n" + viz +
        f"\nadd_local_files([{{name: {name!r}, base64: {b64!r}}}], {view!r});\n"
        "</script>\n</body></html>\n"
    )


def screenshot(chromium: str, page: Path, png: Path, size: str) -> None:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--hide-scrollbars", "--allow-file-access-from-files",
           "--virtual-time-budget=10000", f"--window-size={size}", f"--screenshot={png}",
           page.resolve().as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if p.returncode != 0 or not png.is_file():
        raise SystemExit(f"chromium failed ({p.returncode}):\n{p.stderr[-3000:]}")


DEMO = r"""
import sys
import gpu_arena, gpu_arena.torch as gt
MiB = 1 << 20
gpu_arena.configure("backend=sim,arena_size=256MiB,sim_capacity=4GiB")
gpu_arena.init()
def alloc(n):
    return (gpu_arena.malloc(n), n)
def free(b):
    gpu_arena.free(*b)
gt.record_memory_history(max_entries=100_000, stacks="python")
with gt.annotate("weights"):
    weights = [alloc(s) for s in (64 * MiB, 64 * MiB, 16 * MiB, 4 * MiB, 300_000)]
for step in range(6):
    with gt.annotate("forward"):
        acts = [alloc(24 * MiB + i * MiB) for i in range(8)] + [alloc(70_000) for _ in range(20)]
    with gt.annotate("backward"):
        grads = []
        for a in reversed(acts):
            grads.append(alloc(a[1] // 2))
            free(a)
    with gt.annotate("optimizer"):
        tmp = [alloc(40 * MiB) for _ in range(3)]
        for t in tmp + grads:
            free(t)
gt.dump_snapshot(sys.argv[1])
print("demo snapshot:", sys.argv[1])
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pickle", nargs="?")
    ap.add_argument("--demo", metavar="DIR", help="make a sim snapshot in DIR and render it")
    ap.add_argument("--out-dir", help="where the PNG/HTML go (default: beside the pickle)")
    ap.add_argument("--views", default="timeline,state,segments")
    ap.add_argument("--memoryviz", default=os.environ.get("MEMORYVIZ_JS", "/work/notes/MemoryViz.js"))
    ap.add_argument("--d3")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser")
                    or shutil.which("google-chrome"))
    ap.add_argument("--window-size", default="1600,1000")
    a = ap.parse_args()
    if a.demo:
        d = Path(a.demo)
        d.mkdir(parents=True, exist_ok=True)
        pkl = d / "demo_snapshot.pickle"
        env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
        env.pop("GPU_ARENA_CONF", None)
        subprocess.run([sys.executable, "-c", DEMO, str(pkl)], check=True, env=env)
    elif a.pickle:
        pkl = Path(a.pickle)
    else:
        ap.error("give a snapshot pickle or --demo DIR")
    if not a.chromium:
        raise SystemExit("no Chromium: apt-get install -y chromium, or pass --chromium")
    out_dir = Path(a.out_dir) if a.out_dir else pkl.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    data = pkl.read_bytes()
    if data[:1] == b"\x80" and data[1] > 4:
        raise SystemExit(f"{pkl}: pickle protocol {data[1]}; MemoryViz.js reads 2-4")
    d3, viz = d3_bundle(a.d3), memoryviz_module(a.memoryviz)
    for key in a.views.split(","):
        view = VIEWS[key]
        page = out_dir / f"{pkl.stem}-{key}.html"
        page.write_text(html(data, pkl.name, view, d3, viz))
        png = page.with_suffix(".png")
        screenshot(a.chromium, page, png, a.window_size)
        print(f"{view}: {png} ({png.stat().st_size} bytes; interactive: {page})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
