"""gpu-arena as PyTorch's CUDA allocator (needs torch; most tests need a CUDA GPU).

Every test runs its work in a fresh interpreter: install() must precede PyTorch's CUDA init,
and gpu-arena's init is process-global. The subprocesses drop GPU_ARENA_BACKEND (the ctypes
tests set it to sim) so that gpu-arena picks the real device.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import gpu_check_env, result_of, run_python

MiB = 1 << 20
GiB = 1 << 30
DROP = ["GPU_ARENA_BACKEND", "GPU_ARENA_CONF"]

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

    HAVE_CUDA = bool(torch.cuda.is_available())  # does not initialize CUDA in this process
    HAVE_PLUGGABLE = hasattr(torch._C, "_cuda_customAllocator")
else:
    HAVE_CUDA = HAVE_PLUGGABLE = False

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
needs_gpu = pytest.mark.skipif(
    not HAVE_CUDA,
    reason="torch is not installed" if not HAVE_TORCH
    else "torch.cuda.is_available() is False (no CUDA device here)",
)

# A deterministic workload touching many sizes, views, in-place ops, cuBLAS and a side
# stream with record_stream. Returns CPU copies of its results.
WORKLOAD = r'''
import torch

def workload():
    g = torch.Generator(device="cuda").manual_seed(1234)
    out = {}
    xs = [torch.randn(n, device="cuda", generator=g) for n in (1, 100, 4097, 1 << 20, 3 << 20)]
    a = torch.randn(1024, 768, device="cuda", generator=g)
    b = torch.randn(768, 512, device="cuda", generator=g)
    out["mm"] = a @ b
    out["sum"] = torch.stack([x.sum() for x in xs])
    t = torch.arange(10_000_000, device="cuda", dtype=torch.float32)
    t.mul_(0.5).add_(1)
    out["t"] = t[::9973].clone()
    acc = torch.zeros(4096, device="cuda")
    for i in range(300):  # churn: many short-lived tensors of many sizes
        y = torch.full((512 * (1 + i % 37) + i,), float(i % 11), device="cuda")
        k = min(y.numel(), 4096)
        acc[:k] += y[:k]
    out["acc"] = acc
    side = torch.cuda.Stream()
    big = torch.ones(1 << 22, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r = big * 3
    big.record_stream(side)
    torch.cuda.current_stream().wait_stream(side)
    r.record_stream(torch.cuda.current_stream())
    out["stream"] = r[:1000].clone()
    del big, r
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in out.items()}


def settle():
    """Free what can be freed (cuBLAS workspaces, caches) and return the device's free bytes."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    import gpu_arena.torch
    gpu_arena.torch.empty_cache()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
'''


def compare(reference: dict, got: dict):
    assert reference.keys() == got.keys()
    for k in reference:
        if k == "mm":
            torch.testing.assert_close(got[k], reference[k], rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(got[k], reference[k]), k


@needs_torch
@pytest.mark.skipif(HAVE_TORCH and not HAVE_PLUGGABLE, reason="this torch build has no CUDA support")
def test_install_wiring_without_touching_the_device():
    """The pluggable route's hooks and swap, checked against the installed torch's bindings.
    Runs without a GPU: nothing here touches device memory (the sim backend is allowed for
    that reason). The native route: tests/gpu/gpu_torch_native.py."""
    proc = run_python(
        """
        import torch, gpu_arena, gpu_arena.torch as gt
        from result_channel import report
        torch.cuda.is_available = lambda: True          # no CUDA call below
        real_is_init = torch.cuda.is_initialized
        torch.cuda.is_initialized = lambda: True
        try:
            gt.install(allow_sim=True, route="pluggable")
            already = None
        except gt.AlreadyInitializedError as e:
            already = str(e)
        torch.cuda.is_initialized = real_is_init
        try:
            gt.install(route="pluggable")
            sim_refused = None
        except gt.TorchIntegrationError as e:
            sim_refused = str(e)
        alloc = gt.install(allow_sim=True, route="pluggable")  # gpu-arena is initialized already (above)
        again = gt.install(allow_sim=True, route="pluggable")
        try:
            gt.install("arena_size=8MiB", allow_sim=True, route="pluggable")
            late_conf = None
        except gpu_arena.InvalidStateError as e:
            late_conf = e.code
        native = alloc.allocator()
        report({
            "already": already, "sim_refused": sim_refused, "same": again is alloc,
            "late_conf": late_conf, "installed": gt.installed(),
            "current_is_ours": torch._C._cuda_getAllocator() is not None,
            "backend": gpu_arena.backend_name(),
            "hooks": [h for h in ("set_init_fn", "set_reset_fn", "set_record_stream_fn")
                      if hasattr(native, h)],
        })
        """,
        env={"GPU_ARENA_BACKEND": "sim"},
    )
    r = result_of(proc)
    assert "call install() before the first CUDA allocation" in r["already"]
    assert "sim" in r["sim_refused"]
    assert r["same"] and r["installed"] and r["backend"] == "sim"
    assert r["late_conf"] == -7
    assert r["hooks"] == ["set_init_fn", "set_reset_fn", "set_record_stream_fn"]


def test_torch_module_imports_without_torch():
    proc = run_python(
        """
        import sys
        from result_channel import report
        sys.modules["torch"] = None          # make `import torch` fail
        import gpu_arena.torch as gt
        try:
            gt.install()
            r = None
        except ImportError as e:
            r = str(e)
        report(r)
        """
    )
    assert "needs PyTorch" in result_of(proc)


@needs_gpu
def test_install_matches_default_allocator_and_returns_memory(tmp_path):
    ref_file, got_file = tmp_path / "ref.pt", tmp_path / "got.pt"
    ref = run_python(
        WORKLOAD
        + f"""
from result_channel import report
torch.save(workload(), {str(ref_file)!r})
report(torch.cuda.memory._get_current_allocator() is not None)
""",
        drop=DROP,
        env=gpu_check_env(),
    )
    result_of(ref)

    proc = run_python(
        """
import gpu_arena, gpu_arena.torch as gt
from result_channel import report
gt.install("arena_size=256MiB")
"""
        + WORKLOAD
        + f"""
dev = torch.cuda.current_device()
out = {{"backend": gpu_arena.backend_name(), "initialized_by_install": gpu_arena.is_initialized()}}
workload()                      # warm-up: context, kernels, cuBLAS handle
base_free = settle()
base_stats = gpu_arena.stats(dev)
res = workload()
torch.save(res, {str(got_file)!r})
del res                         # its tensors would keep an arena alive
big = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
big[0].fill_(7)
torch.cuda.synchronize()
out["free_during"] = torch.cuda.mem_get_info()[0]
out["stats_during"] = gpu_arena.stats(dev)
ptrs = [t.data_ptr() for t in big]
snap = gpu_arena.snapshot()
arenas = [a for d in snap["devices"] if d["device"] == dev for a in d["arenas"]]
out["ptrs_in_arenas"] = all(any(a["base"] <= p < a["base"] + a["bytes"] for a in arenas) for p in ptrs)
del big
torch.cuda.synchronize()
getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()  # torch keeps these live
torch.cuda.empty_cache()        # the reset hook alone (set_reset_fn -> gpu_arena_reset)
out["stats_after_torch_empty_cache"] = gpu_arena.stats(dev)
out["free_after"] = settle()
out["stats_after"] = gpu_arena.stats(dev)
out["base_free"], out["base_stats"] = base_free, base_stats
gpu_arena.validate(dev)
report(out)
""",
        drop=DROP,
        env=gpu_check_env(),
    )
    r = result_of(proc)
    assert r["backend"] in ("cuda", "hip") and r["initialized_by_install"]
    compare(torch.load(ref_file), torch.load(got_file))

    during, after = r["stats_during"], r["stats_after"]
    assert during["allocations"] >= 4 and during["reserved_bytes"] >= GiB
    assert r["ptrs_in_arenas"], "tensor memory is not inside gpu-arena's arenas"
    assert r["base_free"] - r["free_during"] >= GiB - 2 * MiB
    assert during["alloc_count"] > r["base_stats"]["alloc_count"]
    assert r["stats_after_torch_empty_cache"]["reserved_bytes"] <= r["base_stats"]["reserved_bytes"], (
        "torch.cuda.empty_cache() did not reach gpu_arena_reset (set_reset_fn)"
    )
    assert after["reserved_bytes"] == r["base_stats"]["reserved_bytes"]
    assert after["allocations"] == r["base_stats"]["allocations"]
    assert abs(r["free_after"] - r["base_free"]) <= 2 * MiB, (r["free_after"], r["base_free"])


@needs_gpu
def test_install_after_cuda_init_is_refused():
    proc = run_python(
        """
        import torch, gpu_arena.torch as gt
        from result_channel import report
        x = torch.zeros(1, device="cuda")
        try:
            gt.install()
            r = None
        except gt.AlreadyInitializedError as e:
            r = str(e)
        report([r, gt.installed()])
        """,
        drop=DROP,
        env=gpu_check_env(),
    )
    msg, installed = result_of(proc)
    assert msg and "call install() before the first CUDA allocation" in msg
    assert not installed


@needs_gpu
@pytest.mark.skipif(HAVE_TORCH and not hasattr(torch.cuda, "use_mem_pool"),
                    reason="this torch has no torch.cuda.MemPool / use_mem_pool")
def test_mem_pool(tmp_path):
    proc = run_python(
        WORKLOAD
        + """
import gpu_arena, gpu_arena.torch as gt
from result_channel import report
torch.cuda.init()
dev = torch.cuda.current_device()
workload()                                    # default allocator; warms kernels and cuBLAS
x_ref = torch.randn(64 << 20, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
ref = float((x_ref * 2).sum())
del x_ref
pool = gt.mem_pool()                          # initializes gpu-arena
base_free = settle()
base_stats = gpu_arena.stats(dev)
with torch.cuda.use_mem_pool(pool):
    x = torch.randn(64 << 20, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    y = torch.empty(1000, device="cuda")
outside = torch.empty(1000, device="cuda")    # back to the default allocator
torch.cuda.synchronize()
during = gpu_arena.stats(dev)
snap = gpu_arena.snapshot()
arenas = [a for d in snap["devices"] if d["device"] == dev for a in d["arenas"]]
inside = lambda p: any(a["base"] <= p < a["base"] + a["bytes"] for a in arenas)
out = {"x_in": inside(x.data_ptr()), "y_in": inside(y.data_ptr()),
       "outside_in": inside(outside.data_ptr()), "during": during, "base_stats": base_stats,
       "got": float((x * 2).sum()), "ref": ref}
del x, y, outside
del pool
out["free_after"] = settle()
out["after"] = gpu_arena.stats(dev)
out["base_free"] = base_free
gpu_arena.validate(dev)
report(out)
""",
        drop=DROP,
        env=gpu_check_env(),
    )
    r = result_of(proc)
    assert r["x_in"] and r["y_in"], "pool allocations are not in gpu-arena's arenas"
    assert not r["outside_in"], "an allocation outside use_mem_pool went to gpu-arena"
    assert r["during"]["reserved_bytes"] >= 256 * MiB
    assert r["during"]["allocations"] > r["base_stats"]["allocations"]
    assert r["got"] == pytest.approx(r["ref"], rel=1e-5)
    assert r["after"]["allocations"] == r["base_stats"]["allocations"], "pool segments not freed"
    assert r["after"]["reserved_bytes"] == r["base_stats"]["reserved_bytes"]
    assert abs(r["free_after"] - r["base_free"]) <= 2 * MiB, (r["free_after"], r["base_free"])
