"""gpu_arena.torch's PyTorch-shaped stats, history and snapshots on the sim backend (no
torch, no GPU): memory_stats keys and values, memory_summary's table, the event ring with
annotate() labels and Python stacks, memory_snapshot's structure as PyTorch's viewers need it
(check_snapshot), and the pickle protocol. Each test runs in a fresh process (gpu-arena's
init is process-global)."""

from __future__ import annotations

from conftest import result_of, run_python

MiB = 1 << 20

SETUP = """
import pickle, pickletools, sys
import gpu_arena, gpu_arena.torch as gt
from result_channel import report
from gpu_arena.torch_snapshot import check_snapshot
gpu_arena.configure("backend=sim,arena_size=64MiB,grow_arenas=0,max_reserved=512MiB,sim_capacity=1GiB")
gpu_arena.init()
MiB = 1 << 20
"""


def test_memory_stats_keys_and_values():
    r = result_of(run_python(SETUP + """
a = gpu_arena.malloc(3 * MiB)
b = gpu_arena.malloc(1000)
gpu_arena.free(a, 3 * MiB)
try:
    gpu_arena.malloc(1 << 30)
except gpu_arena.OutOfMemoryError:
    pass
s = gt.memory_stats()
report({"stats": s, "keys": list(s), "raw": gpu_arena.stats(),
       "alloc": gt.memory_allocated(), "res": gt.memory_reserved(),
       "maxalloc": gt.max_memory_allocated(), "maxres": gt.max_memory_reserved(0),
       "summary": gt.memory_summary(), "dev1": gt.memory_stats("cuda:0")["num_ooms"]})
"""))
    s, raw = r["stats"], r["raw"]
    assert r["keys"] == sorted(r["keys"])
    assert s["allocated_bytes.all.current"] == raw["allocated_bytes"] == 1024
    assert s["allocated_bytes.all.peak"] == 4 * MiB + 1024  # 3 MiB rounds to 4 MiB
    # The 1000-byte block's 2 MiB small arena is left: the OOM retry released the 3 MiB
    # block's emptied 64 MiB arena.
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["segment.all.current"] == 1 and s["segment.all.allocated"] == 2
    assert s["allocation.all.current"] == 1
    assert s["allocation.all.allocated"] == 2 and s["allocation.all.freed"] == 1
    assert s["num_ooms"] == 1 == r["dev1"]
    assert s["max_split_size"] == -1
    # Never invented: no pool split, no cumulative bytes.
    assert not any("large_pool" in k or "small_pool" in k for k in s)
    assert "allocated_bytes.all.allocated" not in s
    # requested_bytes exactly when the library's stats struct has the field.
    assert ("requested_bytes.all.current" in s) == ("requested_bytes" in raw)
    assert (r["alloc"], r["res"]) == (1024, 2 * MiB)
    assert (r["maxalloc"], r["maxres"]) == (4 * MiB + 1024, 66 * MiB)
    lines = r["summary"].splitlines()
    assert all(len(line) == 77 for line in lines), lines
    assert "gpu-arena CUDA memory summary, device ID 0" in lines[1]
    assert "CUDA OOMs: 1" in lines[3]
    row = next(line for line in lines if line.startswith("| GPU reserved memory"))
    assert row == "| GPU reserved memory   |   2048 KiB |  67584 KiB |     n/a    |     n/a    |"


def test_history_snapshot_for_the_viewers(tmp_path):
    out = tmp_path / "snap.pickle"
    r = result_of(run_python(SETUP + f"""
def step(i):
    with gt.annotate("layer"):
        blocks = [(gpu_arena.malloc(s), s) for s in (512, 70000, 3 * MiB)]
    big = gpu_arena.malloc(100 * MiB)     # its own arena, outside any region
    gpu_arena.free(big, 100 * MiB)
    for p, s in blocks[1:]:
        gpu_arena.free(p, s)
    return blocks[0]

keep0 = gpu_arena.malloc(4096)            # before recording: no event
gt.record_memory_history(max_entries=1000, stacks="python")
kept = [step(i) for i in range(3)]
gpu_arena.empty_cache()                   # the 100 MiB arena goes: segment_free
try:
    gpu_arena.malloc(1 << 30)
except gpu_arena.OutOfMemoryError:
    pass
snap = gt.dump_snapshot({str(out)!r})
gt.record_memory_history(False)
after = gpu_arena.malloc(512)             # stopped: no event, but the earlier ones stay
again = gt.memory_snapshot()
data = open({str(out)!r}, "rb").read()
proto = next(pickletools.genops(data))[1]
report({{"problems": check_snapshot(snap), "again": check_snapshot(again),
    "proto": proto, "n": len(snap["device_traces"][0]), "n_again": len(again["device_traces"][0]),
    "actions": [t["action"] for t in snap["device_traces"][0]],
    "labels": sorted({{t["user_metadata"] for t in snap["device_traces"][0]}}),
    "frames0": snap["device_traces"][0][0]["frames"][:2],
    "segments": [(s["total_size"], [(b["state"], b["size"], b["requested_size"], bool(b["frames"]))
                  for b in s["blocks"]]) for s in snap["segments"]],
    "types": sorted({{(s["segment_type"], s["total_size"]) for s in snap["segments"]}}),
    "keys": sorted(snap)}}, default=str)
"""))
    assert r["problems"] == [] and r["again"] == []
    assert r["proto"] == 4
    assert r["keys"] == ["allocator_settings", "device_traces", "external_annotations", "segments"]
    acts = r["actions"]
    assert acts.count("alloc") == 3 * 4 and acts.count("free_requested") == 3 * 3
    assert acts.count("segment_alloc") >= 1 and acts.count("segment_free") >= 1
    assert acts[-1] == "oom"
    assert r["n_again"] == r["n"]
    assert r["labels"] == ["", "layer"]
    f0 = r["frames0"]
    assert f0[0] == {"name": "layer", "filename": "<gpu_arena.annotate>", "line": 0}
    assert f0[1]["name"] == "step"  # the Python stack at the with statement, innermost first
    live = sorted((b[1], b[2], b[3]) for _, blocks in r["segments"] for b in blocks
                  if b[0] == "active_allocated")
    # keep0 (no frames: allocated before recording) and the three 512-byte blocks (labelled).
    assert live == [(512, 512, True)] * 3 + [(4096, 4096, False)]
    for total, blocks in r["segments"]:
        assert sum(b[1] for b in blocks) == total
    # What is left after empty_cache: the small blocks' 2 MiB arena, a "small" segment.
    assert [list(t) for t in r["types"]] == [["small", 2 * MiB]]


def test_history_off_by_default_and_bad_stacks():
    r = result_of(run_python(SETUP + """
p = gpu_arena.malloc(4096); gpu_arena.free(p, 4096)
snap = gt.memory_snapshot()
try:
    gt.record_memory_history(stacks="cpp")
    err = ""
except ValueError as e:
    err = str(e)
with gt.annotate("x") as cid:
    pass
report({"n": len(snap["device_traces"][0]), "err": err, "cid": cid,
       "problems": check_snapshot(snap)})
"""))
    assert r["n"] == 0 and r["problems"] == []
    assert "stacks='cpp'" in r["err"]
    assert r["cid"] >= 1


def test_check_snapshot_finds_what_breaks_the_viewer():
    r = result_of(run_python("""
from result_channel import report
from gpu_arena.torch_snapshot import check_snapshot
B = 1 << 40
seg = {"device": 0, "address": B, "total_size": 4096, "stream": 0, "blocks": [
    {"size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []},
    {"size": 1024, "requested_size": 0, "state": "weird", "frames": [{"name": 1}]}]}
trace = [{"action": "free_requested", "addr": B, "size": 1, "stream": 0},
         {"action": "oom", "size": 1, "stream": 0}]
report(check_snapshot({"segments": [seg], "device_traces": [trace]}))
"""))
    text = "\n".join(r)
    assert "state 'weird'" in text
    assert "bad frame" in text
    assert "blocks cover 2048 bytes of 4096" in text
    assert "device_free is not an int" in text
    assert "never completed" in text
