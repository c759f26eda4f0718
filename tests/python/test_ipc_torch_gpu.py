"""gpu_arena.share / open / close across two processes on a CUDA GPU (skipped without torch
or without a CUDA device). tests/gpu/gpu_ipc_check.py measures the memory figures; this is
the short regression test of the tensor-level API on the real backend."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from conftest import child_env

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

    HAVE_CUDA = bool(torch.cuda.is_available())  # does not initialize CUDA here
else:
    HAVE_CUDA = False

pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs torch with a CUDA device")

PRODUCER = r'''
import gc, json, sys
import gpu_arena, gpu_arena.torch
gpu_arena.torch.install("backend=cuda,arena_size=64MiB")
import torch
t = torch.arange(1 << 20, dtype=torch.float32, device="cuda").view(1024, 1024)
s = gpu_arena.share(t[3:9, 10:20])
print("SHARE " + s.to_base64(), flush=True)
assert sys.stdin.readline().strip() == "done"
out = {"written": t[3, 10].item(), "imports_live": gpu_arena.stats()["imports_live"]}
s.close()
del t
gc.collect()
torch.cuda.empty_cache()
st = gpu_arena.stats()
out.update(reserved=st["reserved_bytes"], shares=st["shares_live"], exports=st["exports_live"])
print("RESULT=" + json.dumps(out), flush=True)
'''

CONSUMER = r'''
import gc, json, sys
import gpu_arena, gpu_arena.torch
gpu_arena.torch.install("backend=cuda,arena_size=64MiB")
import torch
share = gpu_arena.Share.from_base64(sys.argv[1])
want = torch.arange(1 << 20, dtype=torch.float32, device="cuda").view(1024, 1024)[3:9, 10:20]
out = {}
t = gpu_arena.open(share)
out["device"] = str(t.device)
out["equal"] = torch.equal(t, want)
out["meta"] = [list(t.shape), list(t.stride()), t.storage_offset()]
v = t[1:]
del t
gc.collect()
out["view_keeps"] = gpu_arena.imports_live()
del v
gc.collect()
out["gc_closes"] = gpu_arena.imports_live()
t = gpu_arena.open(share)
t[0, 0] = -1.0
out["explicit"] = [gpu_arena.close(t), gpu_arena.imports_live()]
print("RESULT=" + json.dumps(out), flush=True)
'''


def _env():
    return child_env(drop=("GPU_ARENA_BACKEND", "GPU_ARENA_CONF"))


def _result(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT="):])
    raise AssertionError(f"no RESULT in:\n{text}")


def test_share_open_close_across_processes():
    prod = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PRODUCER)], env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = prod.stdout.readline()
        assert line.startswith("SHARE "), line + prod.stderr.read()
        cons = subprocess.run([sys.executable, "-c", textwrap.dedent(CONSUMER), line.split()[1]],
                              env=_env(), capture_output=True, text=True, timeout=300)
        c = _result(cons.stdout + cons.stderr)
        out, err = prod.communicate("done\n", timeout=300)
        p = _result(out + err)
    finally:
        if prod.poll() is None:
            prod.kill()
    assert c["device"] == "cuda:0"
    assert c["equal"] is True
    assert c["meta"] == [[6, 10], [1024, 1], 3 * 1024 + 10]
    assert c["view_keeps"] == 1 and c["gc_closes"] == 0
    assert c["explicit"] == [1, 0]
    assert p["written"] == -1.0, "the consumer's write reached the producer"
    assert p["imports_live"] == 0
    assert (p["reserved"], p["shares"], p["exports"]) == (0, 0, 0)
