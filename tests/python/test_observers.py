"""Arena observers from Python (gpu_arena.observe_arenas / unobserve_arenas) on the sim
backend, without torch (runs in CI). Each scenario runs in a fresh interpreter, since
gpu-arena's init is process-global and these tests count arenas from zero."""

from __future__ import annotations

from conftest import result_of, run_python

ENV = {"GPU_ARENA_BACKEND": "sim"}
PRELUDE = """
import logging, threading
import gpu_arena
from result_channel import report
gpu_arena.configure("backend=sim,arena_size=8MiB,sim_capacity=1GiB,validate=1")
gpu_arena.init()
MiB = 1 << 20
events = []
def ready(a):
    events.append(("ready", a.arena_id, a.flags))
def release(a):
    import ctypes
    first = ctypes.c_ubyte.from_address(a.base).value   # still mapped
    events.append(("release", a.arena_id, first))
"""


def scenario(code: str) -> dict:
    return result_of(run_python(PRELUDE + code, env=ENV))


def test_ready_release_and_unobserve():
    out = scenario("""
        import ctypes
        p = gpu_arena.malloc(MiB)
        ctypes.memset(p, 0x5A, MiB)
        h = gpu_arena.observe_arenas(ready, release)
        after_observe = list(events)
        big = gpu_arena.malloc(20 * MiB)          # a new (dedicated) arena
        after_big = list(events)
        gpu_arena.free(p, MiB); gpu_arena.free(big, 20 * MiB)
        gpu_arena.empty_cache()
        after_empty = list(events)
        gpu_arena.unobserve_arenas(h)
        try:
            gpu_arena.unobserve_arenas(h)
            second = "accepted"
        except gpu_arena.InvalidArgumentError as e:
            second = e.message
        report(dict(
            after_observe=after_observe, after_big=after_big, after_empty=after_empty,
            final=events, second=second, closed=h.closed,
            errors=gpu_arena.stats()["observer_errors"]))
    """.replace("\n        ", "\n"))
    assert out["after_observe"] == [["ready", 1, 0]], "the existing arena, from observe"
    assert out["after_big"] == [["ready", 1, 0], ["ready", 2, 0]]
    releases = sorted(e for e in out["after_empty"] if e[0] == "release")
    assert [r[1] for r in releases] == [1, 2]
    assert releases[0][2] == 0x5A, "arena 1 still mapped in on_release"
    assert out["final"] == out["after_empty"], "nothing left to release on unobserve"
    assert "not registered" in out["second"]
    assert out["closed"] is True
    assert out["errors"] == 0


def test_exceptions_are_caught_counted_and_refuse_the_arena():
    out = scenario("""
        logging.basicConfig(level=logging.ERROR)
        def bad_ready(a):
            raise RuntimeError("refused by the test")
        def bad_release(a):
            raise RuntimeError("release raises")
        refusing = gpu_arena.observe_arenas(bad_ready, release)
        raising = gpu_arena.observe_arenas(None, bad_release)    # on_ready NULL: takes all
        p = gpu_arena.malloc(MiB)
        ctypes_ok = gpu_arena.stats()["allocations"] == 1
        gpu_arena.free(p, MiB)
        gpu_arena.empty_cache()
        with gpu_arena.observe_arenas(ready, release) as h:
            inside = h.closed
        try:
            gpu_arena.observe_arenas(None, None)
            both_none = "accepted"
        except gpu_arena.InvalidArgumentError as e:
            both_none = e.message
        gpu_arena.unobserve_arenas(refusing)
        gpu_arena.unobserve_arenas(raising.id)                  # by id
        report(dict(
            events=events, ok=ctypes_ok, inside=inside, closed=h.closed, both_none=both_none,
            errors=gpu_arena.stats()["observer_errors"]))
    """.replace("\n        ", "\n"))
    assert out["events"] == [], "no release after a refused ready; the last observer saw none"
    assert out["ok"], "the arena stayed usable"
    assert out["errors"] == 1, "the refused on_ready (an on_release's failure is only logged)"
    assert out["inside"] is False and out["closed"] is True, "the with block unobserved"
    assert "NULL" in out["both_none"]


def test_callbacks_call_back_and_race_with_threads():
    out = scenario("""
        calls = []
        def busy_ready(a):
            calls.append(a.arena_id)
            if len(calls) == 1:                   # re-entrant: allocate and free (once: an
                q = gpu_arena.malloc(4096)        # on_ready that always allocates would
                gpu_arena.free(q, 4096)           # need nested arenas without end)
            gpu_arena.stats()
            ready(a)
        h = gpu_arena.observe_arenas(busy_ready, release)
        stop = threading.Event()
        def work(t):
            for i in range(300):
                size = 10 * MiB if (i + t) % 9 == 0 else 256 * 1024
                p = gpu_arena.malloc(size, 0, 0x1000 * (t + 1))
                gpu_arena.free(p, size)
                if i % 50 == 49:
                    gpu_arena.empty_cache()
        threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
        for t in threads: t.start()
        rounds = 0
        while any(t.is_alive() for t in threads) or rounds < 20:
            mine = []
            o = gpu_arena.observe_arenas(lambda a: mine.append(("r", a.arena_id)),
                                         lambda a: mine.append(("x", a.arena_id)))
            gpu_arena.unobserve_arenas(o)
            r = sorted(i for k, i in mine if k == "r"); x = sorted(i for k, i in mine if k == "x")
            assert r == x, (r, x)
            rounds += 1
        for t in threads: t.join()
        gpu_arena.empty_cache()
        gpu_arena.unobserve_arenas(h)
        r = sorted(e[1] for e in events if e[0] == "ready")
        x = sorted(e[1] for e in events if e[0] == "release")
        report(dict(ready=r, release=x, rounds=rounds, calls=len(calls),
                    errors=gpu_arena.stats()["observer_errors"]))
    """.replace("\n        ", "\n"))
    assert out["ready"] == out["release"], "one release per ready"
    assert out["calls"] == len(out["ready"])
    assert len(set(out["ready"])) == len(out["ready"]), "one ready per arena"
    assert len(out["ready"]) > 1
    assert out["rounds"] >= 20
    assert out["errors"] == 0
