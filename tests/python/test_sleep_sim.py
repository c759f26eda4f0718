"""Tags, sleep and wake from Python on the sim backend, without torch (runs in CI): bad tag
names refused, the offloaded tag bitwise identical at the same addresses after a wake,
the memory really given back while asleep, allocations of a sleeping tag refused, double
sleep / waking an awake tag refused, bad devices, the vLLM-shaped facade and use_tag.
Each scenario runs in a fresh interpreter (gpu-arena's init is process-global)."""

from __future__ import annotations

import textwrap

from conftest import result_of, run_python

ENV = {"GPU_ARENA_BACKEND": "sim"}
PRELUDE = """
import ctypes
import gpu_arena
from result_channel import report
from gpu_arena import InvalidArgumentError, InvalidStateError, InvalidDeviceError
gpu_arena.configure("backend=sim,arena_size=8MiB,grow_arenas=0,sim_capacity=1GiB,validate=1")
gpu_arena.init()
MiB = 1 << 20
def raises(exc, fn, *a, **k):
    try:
        fn(*a, **k)
    except exc as e:
        return str(e)
    return None
"""


def scenario(code: str) -> dict:
    return result_of(run_python(PRELUDE + textwrap.dedent(code), env=ENV))


def test_bad_tags_and_devices_are_refused():
    out = scenario("""
        bad = [raises(InvalidArgumentError, gpu_arena.set_tag, t)
               for t in ("a b", "x/y", "a" * 64, "kv:cache")]
        ok = raises(Exception, gpu_arena.set_tag, "a" * 63)
        gpu_arena.set_tag(None)
        devs = [raises(InvalidDeviceError, gpu_arena.sleep, device=5),
                raises(InvalidDeviceError, gpu_arena.wake, device=-3)]
        badlist = raises(InvalidArgumentError, gpu_arena.sleep, "weights,bad tag")
        report(dict(bad=bad, ok=ok, devs=devs, badlist=badlist,
                    asleep=gpu_arena.stats()["sleeping_bytes"]))
    """)
    assert all(m and "tag" in m for m in out["bad"]), out
    assert out["ok"] is None
    assert all(out["devs"]), out
    assert out["badlist"], out
    assert out["asleep"] == 0, "a refused sleep changed nothing"


def test_sleep_offloads_weights_and_wakes_them_at_the_same_addresses():
    out = scenario("""
        gpu_arena.set_tag("weights")
        w = gpu_arena.malloc(3 * MiB)
        gpu_arena.set_tag("kv_cache")
        kv = gpu_arena.malloc(2 * MiB)
        gpu_arena.set_tag(None)
        pattern = bytes((i * 7 + 3) % 251 for i in range(3 * MiB))
        ctypes.memmove(w, pattern, len(pattern))
        ctypes.memset(kv, 0x5A, 2 * MiB)
        before = gpu_arena.stats()
        gpu_arena.sleep(offload_tags="weights")
        asleep = gpu_arena.stats()
        gpu_arena.set_tag("kv_cache")
        refused = raises(InvalidStateError, gpu_arena.malloc, MiB)
        gpu_arena.set_tag(None)
        again = raises(InvalidStateError, gpu_arena.sleep, offload_tags=["weights"])
        gpu_arena.wake(["weights"])
        kept = gpu_arena.stats()["offload_host_bytes"]
        gpu_arena.sleep_release_host()
        released = gpu_arena.stats()["offload_host_bytes"]
        same = ctypes.string_at(w, len(pattern)) == pattern
        awake_twice = raises(InvalidStateError, gpu_arena.wake, "weights")
        gpu_arena.wake()
        kv_after = ctypes.string_at(kv, 4)
        nothing = raises(InvalidStateError, gpu_arena.wake)
        after = gpu_arena.stats()
        gpu_arena.free(w, 3 * MiB); gpu_arena.free(kv, 2 * MiB)
        report(dict(
            before=before["reserved_bytes"], asleep_reserved=asleep["reserved_bytes"],
            asleep_sleeping=asleep["sleeping_bytes"], refused=refused, again=again,
            same=same, kept=kept, released=released, awake_twice=awake_twice, kv_after=list(kv_after), nothing=nothing,
            after=after["reserved_bytes"], after_sleeping=after["sleeping_bytes"]))
    """)
    assert out["before"] == 16 << 20
    assert (out["asleep_reserved"], out["asleep_sleeping"]) == (0, 16 << 20)
    assert "asleep" in out["refused"]
    assert out["again"] and out["awake_twice"] and out["nothing"]
    assert out["same"], "weights bitwise identical after sleep/wake"
    assert out["kept"] >= 3 << 20, "the offload's host buffer is kept after the wake"
    assert out["released"] == 0, "sleep_release_host freed it"
    assert out["kv_after"] == [0, 0, 0, 0], "the discarded tag came back as new memory"
    assert (out["after"], out["after_sleeping"]) == (16 << 20, 0)


def test_cumem_compat_facade_and_use_tag():
    out = scenario("""
        from gpu_arena.torch import CuMemAllocatorCompat, use_tag
        a = CuMemAllocatorCompat.get_instance()
        with a.use_memory_pool(tag="weights"):
            inside = gpu_arena.current_tag()
            w = gpu_arena.malloc(2 * MiB)
        outside = gpu_arena.current_tag()
        try:
            with use_tag("kv_cache"):
                kv = gpu_arena.malloc(2 * MiB)
                raise KeyError("x")
        except KeyError:
            pass
        restored = gpu_arena.current_tag()
        ctypes.memset(w, 0x33, MiB)
        a.sleep(offload_tags=("weights",))
        usage_asleep = a.get_current_usage()
        a.wake_up(tags=["weights"])
        a.wake_up()
        same = ctypes.string_at(w, 8) == b"\\x33" * 8
        gpu_arena.free(w, 2 * MiB); gpu_arena.free(kv, 2 * MiB)
        report(dict(inside=inside, outside=outside, restored=restored,
                    usage_asleep=usage_asleep, same=same, usage=a.get_current_usage()))
    """)
    assert (out["inside"], out["outside"], out["restored"]) == ("weights", "default", "default")
    assert out["usage_asleep"] == 0
    assert out["same"]
    assert out["usage"] == 16 << 20


def test_sleep_one_tag_while_the_other_stays_awake():
    out = scenario("""
        from gpu_arena.torch import CuMemAllocatorCompat
        a = CuMemAllocatorCompat.get_instance()
        with a.use_memory_pool(tag="weights"):
            w = gpu_arena.malloc(2 * MiB)
        with a.use_memory_pool(tag="kv_cache"):
            kv = gpu_arena.malloc(2 * MiB)
        ctypes.memset(w, 0x44, 2 * MiB)
        bad = raises(InvalidArgumentError, gpu_arena.sleep, "weights", tags="kv_cache")
        a.sleep(tags=["kv_cache"])
        st = gpu_arena.stats()
        with a.use_memory_pool(tag="weights"):
            w2 = gpu_arena.malloc(2 * MiB)
        twice = raises(InvalidStateError, gpu_arena.sleep, tags="kv_cache")
        same = ctypes.string_at(w, 8) == b"\\x44" * 8
        a.wake_up(tags=["kv_cache"])
        after = gpu_arena.stats()
        for p in (w, w2, kv):
            gpu_arena.free(p, 2 * MiB)
        report(dict(bad=bad, reserved=st["reserved_bytes"],
                    sleeping=st["sleeping_bytes"], twice=twice, same=same,
                    after=after["sleeping_bytes"]))
    """)
    assert out["bad"] and "weights" in out["bad"], out
    assert (out["reserved"], out["sleeping"]) == (8 << 20, 8 << 20), out
    assert out["twice"], out
    assert out["same"], "the awake tag kept its contents"
    assert out["after"] == 0


def test_trim_cuts_arenas_down_to_their_survivors_pages():
    out = scenario("""
        blocks = [gpu_arena.malloc(2 * MiB) for _ in range(12)]  # three 8 MiB arenas
        keep = [blocks[1], blocks[9]]
        for i, p in enumerate(keep):
            ctypes.memmove(p, bytes([i + 7]) * (2 * MiB), 2 * MiB)
        for p in blocks:
            if p not in keep:
                gpu_arena.free(p, 2 * MiB)
        before = gpu_arena.stats()["reserved_bytes"]
        released = gpu_arena.trim()
        after = gpu_arena.stats()["reserved_bytes"]
        same = [ctypes.string_at(p, 2 * MiB) == bytes([i + 7]) * (2 * MiB) for i, p in enumerate(keep)]
        bad = raises(InvalidDeviceError, gpu_arena.trim, 7)
        gpu_arena.validate()
        for p in keep:
            gpu_arena.free(p, 2 * MiB)
        gpu_arena.empty_cache()
        report(dict(before=before, after=after, released=released, same=same,
                    bad=bad, end=gpu_arena.stats()["reserved_bytes"]))
    """)
    MiB = 1 << 20
    assert out["after"] == 4 * MiB, out
    assert out["released"] == out["before"] - out["after"], out
    assert out["same"] == [True, True], out
    assert out["bad"], out
    assert out["end"] == 0, out


def test_sleep_prepare_pins_ahead_and_the_sleep_reuses_what_it_made():
    out = scenario("""
        gpu_arena.set_tag("weights")
        w = [gpu_arena.malloc(6 * MiB) for _ in range(2)]       # two 8 MiB arenas
        gpu_arena.set_tag(None)
        for i, p in enumerate(w):
            ctypes.memset(p, 0x30 + i, 6 * MiB)
        refused = raises(InvalidArgumentError, gpu_arena.sleep_prepare, "")
        made = gpu_arena.sleep_prepare("weights")
        held = gpu_arena.stats()["offload_host_bytes"]
        gpu_arena.sleep(offload_tags="weights", tags="weights")
        held_asleep = gpu_arena.stats()["offload_host_bytes"]
        gpu_arena.wake()
        same = all(ctypes.string_at(p, 6 * MiB) == bytes([0x30 + i]) * (6 * MiB)
                   for i, p in enumerate(w))
        again = gpu_arena.sleep_prepare(["weights"])
        gpu_arena.sleep_release_host()
        report(dict(refused=refused, made=made, held=held, held_asleep=held_asleep,
                    same=same, again=again, after=gpu_arena.stats()["offload_host_bytes"]))
    """)
    assert out["refused"], out
    assert out["made"] == out["held"] == 12 << 20, out
    assert out["held_asleep"] == out["held"], "the sleep made no buffer of its own"
    assert out["same"] and out["again"] == 0 and out["after"] == 0, out
