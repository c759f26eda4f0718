"""gpu_arena.share / open / close across two processes on a CUDA GPU (skipped without torch
or without a CUDA device). tests/gpu/gpu_ipc_check.py measures the memory figures; this is
the short regression test of the tensor-level API on the real backend."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
from conftest import finish, gpu_check_env, result_of, run_python, start_python
from result_channel import ReplyPipe

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

    HAVE_CUDA = bool(torch.cuda.is_available())  # does not initialize CUDA here
else:
    HAVE_CUDA = False

pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs torch with a CUDA device")

PRODUCER = r'''
import gc, sys
import gpu_arena, gpu_arena.torch
from result_channel import report, reply_stream
gpu_arena.torch.install("backend=cuda,arena_size=64MiB")
import torch
t = torch.arange(1 << 20, dtype=torch.float32, device="cuda").view(1024, 1024)
s = gpu_arena.share(t[3:9, 10:20])
replies = reply_stream()          # line buffered
print("SHARE " + s.to_base64(), file=replies)
assert sys.stdin.readline().strip() == "done"
out = {"written": t[3, 10].item(), "imports_live": gpu_arena.stats()["imports_live"]}
s.close()
del t
gc.collect()
torch.cuda.empty_cache()
st = gpu_arena.stats()
out.update(reserved=st["reserved_bytes"], shares=st["shares_live"], exports=st["exports_live"])
report(out)
'''

CONSUMER = r'''
import gc, sys
import gpu_arena, gpu_arena.torch
from result_channel import report
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
report(out)
'''


DROP = ("GPU_ARENA_BACKEND", "GPU_ARENA_CONF")


def test_share_open_close_across_processes():
    replies = ReplyPipe()
    try:
        prod = start_python(PRODUCER, drop=DROP, env={**replies.env, **gpu_check_env()}, stdin=subprocess.PIPE,
                            pass_fds=(replies.fd,))
    finally:
        replies.started()
    try:
        line = replies.reader.readline()
        if not line.startswith("SHARE "):
            p = finish(prod, timeout=60)
            raise AssertionError(f"no share from the producer ({line!r}):\n{p.stdout}{p.stderr}")
        c = result_of(run_python(CONSUMER, drop=DROP, env=gpu_check_env(), args=[line.split()[1]], timeout=300))
        p = result_of(finish(prod, "done\n", timeout=300))
    finally:
        replies.close()
        if prod.poll() is None:
            prod.kill()
            finish(prod)
    assert c["device"] == "cuda:0"
    assert c["equal"] is True
    assert c["meta"] == [[6, 10], [1024, 1], 3 * 1024 + 10]
    assert c["view_keeps"] == 1 and c["gc_closes"] == 0
    assert c["explicit"] == [1, 0]
    assert p["written"] == -1.0, "the consumer's write reached the producer"
    assert p["imports_live"] == 0
    assert (p["reserved"], p["shares"], p["exports"]) == (0, 0, 0)
