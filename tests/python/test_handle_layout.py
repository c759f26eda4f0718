"""The share handle's layout has one home, Rust's ``layout::FIELDS`` (alloc/src/ipc/handle.rs),
which the library hands out (``gpu_arena_share_layout``) with its own decoder
(``gpu_arena_share_fields``). Python's decoder (gpu_arena/handle.py, ``ShareHandle``) reads
the layout from the library at run time; it is checked against the library: the layout it
uses is the one served (covering the handle, a property for every field that carries a
value), and every field of a handle the library made (on the sim backend, in a fresh
process) decodes as the library decodes it and as the pool sees it (pid, device, arena id
and size, offset, length)."""

from __future__ import annotations

import ctypes

import pytest
from conftest import result_of, run_python

import gpu_arena
from gpu_arena import _lib
from gpu_arena.handle import _layout

MiB = 1 << 20

# A child on the sim backend (device 1, so no field is 0 by chance): it shares a range in the
# middle of an arena, and reports the handle, the library's layout and decoding, and the
# pool's view of the arena.
CHILD = r"""
import ctypes, os
import gpu_arena
from gpu_arena import _lib
from result_channel import report

gpu_arena.configure("backend=sim,sim_devices=2,sim_capacity=1GiB,arena_size=64MiB")
lib = _lib.lib()
n = lib.gpu_arena_share_layout(None, 0)
fields = (_lib.GpuArenaShareField * n)()
assert lib.gpu_arena_share_layout(fields, n) == n
layout = {f.name.decode(): [f.offset, f.len] for f in fields}

first = gpu_arena.malloc(1 << 20, device=1)
gpu_arena.share_ptr(first, 4096)             # the share below gets key 1, not 0
p = gpu_arena.malloc(1 << 20, device=1)
h = gpu_arena.share_ptr(p + 4096, 8192)
out = _lib.GpuArenaShareFields()
_lib.check(lib.gpu_arena_share_fields(ctypes.byref(h._struct()), ctypes.byref(out)), "fields")
decoded = {name: getattr(out, name) for name, _ in out._fields_}
decoded["token"] = bytes(out.token).hex()
decoded["socket_name"] = out.socket_name.decode()
arena = next(a for a in gpu_arena.snapshot()["devices"][1]["arenas"]
             if a["base"] <= p < a["base"] + a["bytes"])
report({"handle": h.hex(), "layout": layout, "decoded": decoded, "pid": os.getpid(),
        "ptr": p + 4096, "arena": {"id": arena["id"], "base": arena["base"],
                                   "bytes": arena["bytes"]}})
"""

# The ShareHandle property of each field the library decodes.
PROPERTY = {"len": "length"}


@pytest.fixture(scope="module")
def made():
    return result_of(run_python(CHILD))


def test_python_layout_is_the_library_layout(made):
    layout = _layout()
    assert {k: tuple(v) for k, v in made["layout"].items()} == layout
    assert list(made["layout"]) == list(layout), "in byte order"
    # The fields follow each other and cover the handle.
    at = 0
    for name, (offset, n) in layout.items():
        assert offset == at, name
        at += n
    assert at == gpu_arena.ShareHandle.SIZE
    # Every field that carries a value has its property (the rest: magic and reserved bytes).
    valued = set(layout) - {"magic", "reserved0", "reserved1", "token"}
    missing = [f for f in valued if not hasattr(gpu_arena.ShareHandle, PROPERTY.get(f, f))]
    assert not missing, f"fields of the served layout without a ShareHandle property: {missing}"


def test_every_field_of_a_library_made_handle(made):
    h = gpu_arena.ShareHandle.from_hex(made["handle"])
    lib = made["decoded"]
    assert len(lib) == 10, sorted(lib)
    # Each field, as Python's decoder reads it, against the library's decoding.
    for name, value in lib.items():
        if name == "token":
            assert h._field("token").hex() == value
        else:
            assert getattr(h, PROPERTY.get(name, name)) == value, name
    # ... and against what the producer's pool knows.
    arena = made["arena"]
    assert (h.device, h.producer_pid, h.length) == (1, made["pid"], 8192)
    assert (h.arena_id, h.arena_bytes) == (arena["id"], arena["bytes"])
    assert h.offset == made["ptr"] - arena["base"] and h.offset > 0
    assert h.share_key > 0 and h.socket_name and len(set(h._field("token"))) > 1
    # The fields that carry no value: magic, version, reserved bytes.
    assert h.is_gpu_arena and h._field("magic") == b"GPUARENA" and h.version == 1
    assert h._field("reserved0") == bytes(2) and h._field("reserved1") == bytes(4)


def test_the_library_refuses_a_malformed_handle():
    h = bytearray(gpu_arena.ShareHandle.SIZE)
    s = _lib.GpuArenaShare.from_buffer_copy(bytes(h))
    out = _lib.GpuArenaShareFields()
    rc = _lib.lib().gpu_arena_share_fields(ctypes.byref(s), ctypes.byref(out))
    assert rc == _lib.GPU_ARENA_ERR_IPC and "magic" in _lib.last_error()
