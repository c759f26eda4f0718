"""The transfer engine's C calls (gpu_arena_xfer_*, what NIXL's GPU_ARENA backend calls) with
bad input, through ctypes on the sim backend: each refused with its error code and words, and
nothing changed (the engine still works after). Runs in a fresh interpreter."""

from __future__ import annotations

import textwrap

from conftest import result_of, run_python
from gpu_arena import _lib

CODE = """
import ctypes
import gpu_arena
from gpu_arena import _lib
from result_channel import report
gpu_arena.configure("backend=sim,arena_size=8MiB,sim_capacity=1GiB")
lib = _lib.lib()
def call(name, *args):
    rc = getattr(lib, "gpu_arena_xfer_" + name)(*args)
    return rc, (_lib.last_error() if rc < 0 else "")
eng = ctypes.c_uint64()
out = {}
out["null_agent"] = call("engine_new", None, ctypes.byref(eng))
assert call("engine_new", b"a", ctypes.byref(eng))[0] == 0
e = eng.value
md = ctypes.c_uint64()
host = ctypes.create_string_buffer(4096)
out["foreign_memory"] = call("register_mem", e, ctypes.addressof(host), 4096, ctypes.byref(md))
out["bad_engine"] = call("register_mem", 999, 0, 1, ctypes.byref(md))
out["null_out"] = call("register_mem", e, 0, 1, None)
out["bad_remote"] = call("load_remote", e, b"peer", b"hello", 5, ctypes.byref(md))
out["bad_conn"] = call("load_conn_info", e, b"peer", b"tcp://x")
out["bad_op"] = call("prepare", e, 7, None, None, 0, b"a", ctypes.byref(md))
out["bad_desc"] = call("prepare", e, 0, None, None, 1, b"a", ctypes.byref(md))
out["no_request"] = call("check", e, 12345, ctypes.byref(ctypes.c_int()))
out["unknown_md"] = call("deregister_mem", e, 42)
out["no_peer_notify"] = call("notify", e, b"nobody", b"x", 1)
# Nothing changed: a real registration and its public data still work.
p = gpu_arena.malloc(1 << 20)
ok_reg = call("register_mem", e, p, 1 << 20, ctypes.byref(md))
s = ctypes.c_void_p()
ok_pub = call("public_data", e, md.value, ctypes.byref(s))
lib.gpu_arena_string_free(s)
ok_dereg = call("deregister_mem", e, md.value)
out["ok"] = [ok_reg[0], ok_pub[0], ok_dereg[0]]
out["free"] = call("engine_free", e)
out["free_twice"] = call("engine_free", e)
gpu_arena.free(p, 1 << 20)
report(out)
"""


def test_bad_input_to_the_transfer_calls_is_refused_in_words():
    out = result_of(run_python(textwrap.dedent(CODE), env={"GPU_ARENA_BACKEND": "sim"}))
    E_INVALID = _lib.GPU_ARENA_ERR_INVALID_ARGUMENT
    for key, words in [("null_agent", "agent is NULL"), ("foreign_memory", "not gpu-arena memory"),
                       ("bad_engine", "not a live transfer engine"), ("null_out", "out_md is NULL"),
                       ("bad_remote", "not a gpu-arena registration"),
                       ("bad_conn", "not a gpu-arena transfer socket"), ("bad_op", "op 7"),
                       ("bad_desc", "local is NULL"), ("no_request", "not live"),
                       ("unknown_md", "not a registration"), ("no_peer_notify", "no connection info"),
                       ("free_twice", "not a live transfer engine")]:
        rc, msg = out[key]
        assert rc == E_INVALID and words in msg, (key, rc, msg)
    assert out["ok"] == [0, 0, 0] and out["free"][0] == 0, out

