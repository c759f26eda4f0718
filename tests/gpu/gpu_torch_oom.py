#!/usr/bin/env python3
"""Out of memory through gpu-arena's PyTorch routes raises (never a NULL tensor), is
catchable, and the GPU keeps working (issue #11 item 1). Run on the GPU machine:

    GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONPATH=$PWD/python \\
        python3 tests/gpu/gpu_torch_oom.py --out gpu-out/torch_oom.md

Each case runs in its own subprocess (install() must precede CUDA init; gpu-arena's init is
process-global):

* ``install-auto``: ``gpu_arena.torch.install()`` (the native allocator); ``install-torch`` /
  ``install-runtime``: ``gpu_arena.torch.install(oom=..., route="pluggable")``,
  then ``torch.empty(400 << 30, dtype=uint8, device="cuda").fill_(1)`` (the issue's repro);
* ``mempool``: ``torch.cuda.use_mem_pool(gpu_arena.torch.mem_pool())`` around the same;
* ``use_on_oom``: a gpu-arena MemPool made with ``use_on_oom=True`` holding a freed 8 GiB
  block; the device is then filled with torch's default allocator and a 6 GiB allocation
  *outside* the pool must be served from the pool's cached block (and a control pool
  without ``use_on_oom`` must raise instead).

Each records the exception's type (and whether it is ``torch.OutOfMemoryError`` and a
``RuntimeError``), whether the message contains "out of memory" (vLLM's test), then runs a
tensor op whose result is checked (sum of ``arange`` and a 64 MiB ``fill_``) and
``torch.cuda.synchronize()`` (a corrupted context fails here). The table goes to ``--out``
(and stdout); exit 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_common import child_env, out_path  # beside this file
from result_channel import NO_RESULT, report, run_reporting  # tests/python (gpu_common's path): a child's own channel

CASES = ("install-auto", "install-torch", "install-runtime", "mempool", "use_on_oom")
HUGE = 400 << 30


def _after_ok(torch) -> dict:
    """A normal op after the OOM: right result, no sticky CUDA error."""
    n = 1 << 20
    x = torch.arange(n, device="cuda", dtype=torch.float64)
    y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(3)
    torch.cuda.synchronize()
    ok = float(x.sum().item()) == n * (n - 1) / 2 and int(y.sum().item()) == 3 * (64 << 20)
    return {"after_ok": ok}


def _try_huge(torch) -> dict:
    out: dict = {}
    try:
        t = torch.empty(HUGE, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        out["exc"] = f"NO EXCEPTION (data_ptr={t.data_ptr():#x})"
    except Exception as e:  # noqa: BLE001 - recorded
        out["exc"] = f"{type(e).__module__}.{type(e).__qualname__}"
        out["torch_oom"] = isinstance(e, torch.OutOfMemoryError)
        out["runtime_error"] = isinstance(e, RuntimeError)
        out["has_oom_text"] = "out of memory" in str(e)
        out["msg"] = str(e).splitlines()[0][:400] if str(e) else ""
    return out


def child(case: str) -> dict:
    import gpu_arena
    import gpu_arena.torch as gt

    res: dict = {"case": case}
    if case.startswith("install-"):
        oom = case.split("-", 1)[1]
        import torch

        # install-auto: the default (the native allocator); the oom= routes are the
        # pluggable route's, so those cases name it.
        if oom == "auto":
            gt.install()
        else:
            gt.install(oom=oom, route="pluggable")
        res["route"] = f"{gt.route_in_use()}/{gt.oom_route()}"
        res.update(_try_huge(torch))
        res.update(_after_ok(torch))
        res["num_ooms"] = gt.memory_stats()["num_ooms"]
        return res
    import torch

    torch.zeros(1, device="cuda")
    if case == "mempool":
        pool = gt.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            res.update(_try_huge(torch))
            res.update(_after_ok(torch))
        res["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
        res["gpu_arena_ooms"] = gpu_arena.stats()["oom_count"]
        return res
    # use_on_oom: PyTorch tries the free blocks cached in use_on_oom pools when an
    # allocation outside them runs out.
    for use_on_oom in (True, False):
        tag = "on" if use_on_oom else "off"
        pool = gt.mem_pool(use_on_oom=use_on_oom)
        with torch.cuda.use_mem_pool(pool):
            held = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        seg = (held.data_ptr(), held.data_ptr() + (8 << 30))
        del held  # back to the pool's cache; the segment stays gpu-arena memory
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(max(free - (4 << 30), 0), dtype=torch.uint8, device="cuda")
        try:
            y = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
            y.fill_(5)
            torch.cuda.synchronize()
            res[f"{tag}_served"] = True
            res[f"{tag}_from_pool"] = seg[0] <= y.data_ptr() < seg[1]
            res[f"{tag}_value_ok"] = int(y[-1].item()) == 5
            del y
        except Exception as e:  # noqa: BLE001 - recorded
            res[f"{tag}_served"] = False
            res[f"{tag}_exc"] = f"{type(e).__module__}.{type(e).__qualname__}"
        del filler
        del pool
        torch.cuda.empty_cache()
        gt.empty_cache()
    res.update(_after_ok(torch))
    return res


def passed(r: dict) -> bool:
    if "error" in r or not r.get("after_ok"):
        return False
    case = r["case"]
    if case == "use_on_oom":
        return bool(r.get("on_served") and r.get("on_from_pool") and r.get("on_value_ok")
                    and r.get("off_served") is False)
    if not (r.get("runtime_error") and r.get("has_oom_text")):
        return False
    if case in ("install-torch", "mempool"):
        return bool(r.get("torch_oom"))
    if case == "install-runtime":
        return r.get("route") == "pluggable/runtime"
    # install-auto: the native route raises torch.OutOfMemoryError.
    return bool(r.get("torch_oom")) and r.get("route") == "native/torch"


def run_case(case: str) -> dict:
    r, proc = run_reporting([sys.executable, __file__, "--child", case], env=child_env(), timeout=600)
    if r is not NO_RESULT:
        return r
    return {"case": case, "error": f"rc={proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"}


def table(results: list) -> str:
    lines = ["# gpu-arena: out of memory through PyTorch (tests/gpu/gpu_torch_oom.py)", "",
             "| case | route | exception | torch.OutOfMemoryError | RuntimeError | 'out of memory' "
             "in message | num_ooms | op after OOM correct | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["case"] == "use_on_oom":
            exc = (f"use_on_oom=True: served={r.get('on_served')} from pool={r.get('on_from_pool')}; "
                   f"False: served={r.get('off_served')} {r.get('off_exc', '')}")
        else:
            exc = r.get("exc", r.get("error", "?"))
        lines.append(f"| {r['case']} | {r.get('route', '-')} | {exc} | {r.get('torch_oom', '-')} | "
                     f"{r.get('runtime_error', '-')} | {r.get('has_oom_text', '-')} | "
                     f"{r.get('num_ooms', '-')} | {r.get('after_ok', '-')} | "
                     f"{'PASS' if passed(r) else 'FAIL'} |")
    lines += ["", "Messages:", ""]
    lines += [f"* {r['case']}: `{r.get('msg', r.get('error', ''))}`" for r in results]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=out_path("torch_oom.md"),
                    help="markdown result table (default $OUT/torch_oom.md, OUT defaulting to gpu-out)")
    ap.add_argument("--child")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    if a.child:
        try:
            r = child(a.child)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            import traceback

            r = {"case": a.child, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
        report(r, default=str)
        return 0
    results = []
    for case in a.cases.split(","):
        print(f"== {case}", file=sys.stderr, flush=True)
        results.append(run_case(case))
        print(json.dumps(results[-1], default=str), file=sys.stderr, flush=True)
    md = table(results)
    print(md)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(md)
    return 0 if all(passed(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
