"""A gpu-arena process driven over stdin and a reply pipe, for the cross-process IPC tests.

Run as ``python ipc_worker.py [CONF]`` with a reply pipe (result_channel.ReplyPipe): it
configures gpu-arena (sim backend unless CONF says otherwise), initializes it, answers
``READY <pid> <gpu_arena.__file__>`` and then serves one JSON request per stdin line,
answering one JSON line ``{"ok": ...}`` or ``{"error": code, "message": ...}``. Answers go
to the reply pipe only (stdout and stderr are a log). Sim pointers are host memory, so
reads and writes are plain memmoves.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

# tests/python/ipc_worker.py -> the repository's python/ (the package), unless the installed
# package is under test (GPU_ARENA_EXPECT_INSTALLED=1, see conftest.py).
if os.environ.get("GPU_ARENA_EXPECT_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import gpu_arena  # noqa: E402
from result_channel import reply_stream  # noqa: E402  (beside this file)


def handle(req: dict):
    op = req["op"]
    if op == "malloc":
        return gpu_arena.malloc(req["n"])
    if op == "free":
        return gpu_arena.free(req["ptr"], req["n"])
    if op == "write":
        data = bytes.fromhex(req["hex"])
        ctypes.memmove(req["ptr"], data, len(data))
        return None
    if op == "read":
        return ctypes.string_at(req["ptr"], req["n"]).hex()
    if op == "share":
        return gpu_arena.share_ptr(req["ptr"], req["n"]).hex()
    if op == "share_many":  # n shares of `size` bytes, back to back from ptr
        return [gpu_arena.share_ptr(req["ptr"] + i * req["size"], req["size"]).hex()
                for i in range(req["count"])]
    if op == "unshare":
        for h in req["handles"]:
            gpu_arena.unshare(bytes.fromhex(h))
        return None
    if op == "import":
        return gpu_arena.import_handle(bytes.fromhex(req["handle"]))
    if op == "import_many":
        return [gpu_arena.import_handle(bytes.fromhex(h)) for h in req["handles"]]
    if op == "share_batch":
        return [h.hex() for h in gpu_arena.pointers.share_ptrs(req["ptrs"], req["sizes"])]
    if op == "import_batch":
        return gpu_arena.pointers.import_handles([bytes.fromhex(h) for h in req["handles"]])
    if op == "close_batch":
        return gpu_arena.pointers.close_imports(req["ptrs"])
    if op == "close":
        return gpu_arena.close_import(req["ptr"])
    if op == "imports_live":
        return gpu_arena.imports_live()
    if op == "stats":
        return gpu_arena.stats(req.get("device", 0))
    if op == "wait_stats":  # poll until stats[key] == value; returns the seconds it took
        t0 = time.monotonic()
        while True:
            s = gpu_arena.stats(0)
            if s[req["key"]] == req["value"]:
                return time.monotonic() - t0
            if time.monotonic() - t0 > req["timeout"]:
                raise TimeoutError(f"stats[{req['key']}] = {s[req['key']]}, not {req['value']}")
            time.sleep(0.002)
    if op == "empty_cache":
        return gpu_arena.empty_cache()
    if op == "validate":
        return gpu_arena.validate(0)
    raise ValueError(f"unknown op {op}")


def main() -> None:
    conf = sys.argv[1] if len(sys.argv) > 1 else "backend=sim,arena_size=64MiB"
    gpu_arena.configure(conf)
    gpu_arena.init()
    replies = reply_stream()  # line buffered: each answer is flushed
    print(f"READY {os.getpid()} {gpu_arena.__file__}", file=replies)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "exit":
            print(json.dumps({"ok": None}), file=replies)
            break
        try:
            reply = {"ok": handle(req)}
        except gpu_arena.GpuArenaError as e:
            reply = {"error": e.code, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            reply = {"error": "python", "message": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=replies)


if __name__ == "__main__":
    main()
