"""What the children of gpu_torch_native.py share (torch_native_children.py,
torch_native_behaviour.py): sizes, the result file, installing gpu-arena before torch, the
report's device info, fp32 settings and differences. Stdlib only at the top: spawned
receivers import the children module, and so this one, before they install gpu-arena."""

from __future__ import annotations

import json
import os


MiB, GiB = 1 << 20, 1 << 30
TOL = 2 * MiB


def write_result(path, value):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, default=str)
    os.replace(tmp, path)


def setup(route):
    """Install gpu-arena on ``route`` ("native" | "pluggable"; "torch": torch's own allocator),
    then import torch. Returns (torch, the gpu_arena module or None)."""
    ga = None
    if route in ("native", "pluggable"):
        import gpu_arena
        import gpu_arena.torch as gt

        gt.install(route=route)
        if gt.route_in_use() != route:
            raise RuntimeError(f"install(route={route!r}) gave route {gt.route_in_use()!r}")
        ga = gpu_arena
    elif route != "torch":
        raise ValueError(f"route {route!r}")
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized before the check started")
    return torch, ga


def info(torch, ga, route):
    d = {"route": route, "torch": torch.__version__, "cuda": torch.version.cuda,
         "gpu": torch.cuda.get_device_name(0),
         "total_bytes": int(torch.cuda.get_device_properties(0).total_memory)}
    if ga is not None:
        import gpu_arena.torch as gt

        st = ga.stats(0)
        d.update(route_in_use=gt.route_in_use(), backend=ga.backend_name(), lib=ga.lib_path(),
                 alloc_count=st["alloc_count"], served_by_gpu_arena=st["alloc_count"] > 0)
    return d


def ieee_fp32(torch):
    """Plain fp32 matmuls (no TF32) so compiled and eager runs compare. torch >= 2.9 refuses a
    mix of the legacy (allow_tf32) and new (fp32_precision) switches, so the new one only where
    it exists; cuDNN is left alone (no convolution or RNN here, and setting conv without rnn is
    such a mix)."""
    m = torch.backends.cuda.matmul
    try:
        if hasattr(m, "fp32_precision"):
            m.fp32_precision = "ieee"
            return f"torch.backends.cuda.matmul.fp32_precision={m.fp32_precision}"
        m.allow_tf32 = False
        return "torch.backends.cuda.matmul.allow_tf32=False"
    except Exception as e:  # noqa: BLE001 - reported
        return f"could not set: {type(e).__name__}: {e}"


def maxdiff(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
