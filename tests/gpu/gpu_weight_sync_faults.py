"""Weight sync's faults on the GPU (issue #47), each in fresh processes under
``gpu_arena.torch.install()``; every child reports on its own result file:

  receiver_killed  the sender sends two buckets (weight_sync.send); the receiver imports the
                   first and is SIGKILLed before the second (still in the pipe, never
                   imported); the sender drops its tensors and empties its cache: its device
                   memory is back at its baseline (its CUDA context only), no share, export or
                   deferred free left.
  sender_killed    the receiver imports a bucket and the sender is SIGKILLed: the receiver's
                   tensors still read the sender's values; once it drops them it holds no
                   import, and the device's free memory is back at the parent's baseline.
  queue            tensors through a torch.multiprocessing Queue (gpu-arena's reductions):
                   data correct, no limbo (nothing left without ipc_collect), a sender that
                   drops a tensor before the receiver unpickles it gives a clear error there.

  python3 tests/gpu/gpu_weight_sync_faults.py [--only receiver_killed,sender_killed,queue]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import gpu_common  # noqa: F401  (python/ and tests/python on the path)
import result_channel

MIB = 1 << 20
N, SIZE = 16, 64 * MIB  # 16 bf16 tensors of 64 MiB per bucket


def used(torch) -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def arena_left() -> dict:
    import gpu_arena

    s = gpu_arena.stats()
    return {k: int(s[k]) for k in ("shares_live", "exports_live", "deferred_free_bytes",
                                   "reserved_bytes", "allocated_bytes")} | {
        "imports_live": int(gpu_arena.imports_live())}


# --- children ----------------------------------------------------------------------------


def with_receiver(target, *args):
    """Install gpu-arena, take the device's baseline (this process's CUDA context only), then
    spawn `target(q, back, *args)`: (torch, baseline, q, back, the receiver's Process)."""
    import gpu_arena.torch

    gpu_arena.torch.install()
    import torch
    import torch.multiprocessing as tmp

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = used(torch)
    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=target, args=(q, back, *args))
    r.start()
    return torch, base, q, back, r


def child_sender(role_args):
    """Sender of receiver_killed: two buckets, the receiver killed after the first."""
    torch, base, q, back, r = with_receiver(receiver_loop, "hold")
    from gpu_arena import weight_sync

    pid = back.get(timeout=120)
    a = [torch.full((SIZE // 2,), float(i), dtype=torch.bfloat16, device="cuda") for i in range(N)]
    b = [torch.full((SIZE // 2,), float(i + 50), dtype=torch.bfloat16, device="cuda") for i in range(N)]
    q.put(weight_sync.send(a))
    assert back.get(timeout=120) == ("got", 0)  # imported the first, holds it
    q.put(weight_sync.send(b))  # in the pipe when it dies
    os.kill(pid, signal.SIGKILL)
    r.join(60)
    del a, b
    torch.cuda.synchronize()
    left = {}
    for _ in range(100):  # the broker hears of the death on its socket
        torch.cuda.empty_cache()
        left = arena_left()
        if left["deferred_free_bytes"] == 0 and left["shares_live"] == 0:
            break
        time.sleep(0.05)
    torch.cuda.empty_cache()
    result_channel.report({"held_mib": (used(torch) - base) / MIB, "left": arena_left(),
                           "receiver_exit": r.exitcode})


def receiver_loop(q, back, mode):
    import gpu_arena.torch

    gpu_arena.torch.install()
    import torch
    from gpu_arena import weight_sync

    torch.zeros(1, device="cuda")
    back.put(os.getpid())
    held = []
    while True:
        msg = q.get()
        got = weight_sync.receive(msg)
        bad = sum(int((t != float(i + (50 if held else 0))).sum()) for i, t in enumerate(got))
        held.append(got)
        back.put(("got", bad))
        if mode != "hold":
            break


def child_producer_for_kill(role_args):
    """Sender of sender_killed: sends one bucket, then waits to be killed."""
    import gpu_arena.torch

    gpu_arena.torch.install()
    import torch
    from gpu_arena import weight_sync

    ts = [torch.full((SIZE // 2,), float(i + 1), dtype=torch.bfloat16, device="cuda") for i in range(N)]
    with open(role_args["bucket"] + ".tmp", "wb") as f:
        import pickle

        pickle.dump(weight_sync.send(ts), f)
    os.replace(role_args["bucket"] + ".tmp", role_args["bucket"])
    time.sleep(600)


def child_consumer_of_dead(role_args):
    """Receiver of sender_killed: imports, waits for the sender's death, reads, drops."""
    import gpu_arena.torch

    gpu_arena.torch.install()
    import pickle

    import torch
    from gpu_arena import weight_sync

    bucket = pickle.load(open(role_args["bucket"], "rb"))
    got = weight_sync.receive(bucket)
    with open(role_args["imported"], "w") as f:
        f.write("1")
    while os.path.exists(role_args["imported"]):  # the parent removes it after the kill
        time.sleep(0.05)
    bad = sum(int((t != float(i + 1)).sum()) for i, t in enumerate(got))
    imports_before = int(__import__("gpu_arena").imports_live())
    del got
    torch.cuda.synchronize()
    result_channel.report({"bad": bad, "imports_before_drop": imports_before,
                           "left": arena_left()})


def child_queue(role_args):
    """The torch.multiprocessing path: data, no limbo, and an early drop's error."""
    torch, base, q, back, r = with_receiver(queue_receiver)
    ts = [torch.full((SIZE // 2,), float(i), dtype=torch.bfloat16, device="cuda") for i in range(N)]
    q.put(ts)
    bad = back.get(timeout=120)
    # A tensor dropped before the receiver unpickles it: the receiver must get a clear error.
    early = torch.ones(SIZE // 2, dtype=torch.bfloat16, device="cuda")
    from gpu_arena import torch_ipc
    from multiprocessing.reduction import ForkingPickler

    data = bytes(ForkingPickler.dumps(early))
    del early
    q.put(("raw", data))
    early_error = back.get(timeout=120)
    q.put(None)
    r.join(60)
    del ts
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no ipc_collect
    result_channel.report({"bad": bad, "early_error": early_error, "receiver_exit": r.exitcode,
                           "held_mib": (used(torch) - base) / MIB, "left": arena_left(),
                           "registered": torch_ipc.registered()})


def queue_receiver(q, back):
    import gpu_arena.torch

    gpu_arena.torch.install()
    import pickle

    import torch

    while True:
        msg = q.get()
        if msg is None:
            return
        if isinstance(msg, tuple) and msg[0] == "raw":
            try:
                pickle.loads(msg[1])
                back.put("no error")
            except Exception as e:  # noqa: BLE001 - the message is the result
                back.put(f"{type(e).__name__}: {e}")
            continue
        bad = sum(int((t != float(i)).sum()) for i, t in enumerate(msg))
        del msg
        torch.cuda.synchronize()
        back.put(bad)


CHILDREN = {"sender": child_sender, "producer_for_kill": child_producer_for_kill,
            "consumer_of_dead": child_consumer_of_dead, "queue": child_queue}


# --- the parent --------------------------------------------------------------------------


def run_child(role, args=None, timeout=300):
    """The child's report; RuntimeError with its output's tail when it reported nothing."""
    value, proc = result_channel.run_reporting(
        [sys.executable, __file__, "--child", role, "--args", json.dumps(args or {})],
        env=gpu_common.child_env(), timeout=timeout)
    if value is result_channel.NO_RESULT:
        raise RuntimeError(f"{role}: no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return value


def check_receiver_killed():
    r = run_child("sender")
    ok = r["held_mib"] <= 2 and all(r["left"][k] == 0 for k in r["left"])
    return ok, r


def check_sender_killed():
    import torch

    torch.cuda.init()
    base = used(torch)
    tmp = gpu_common.out_path("weight_sync_kill")
    os.makedirs(tmp, exist_ok=True)
    paths = {"bucket": os.path.join(tmp, "bucket.pkl"), "imported": os.path.join(tmp, "imported")}
    for p in paths.values():
        if os.path.exists(p):
            os.remove(p)
    prod = subprocess.Popen([sys.executable, __file__, "--child", "producer_for_kill", "--args",
                             json.dumps(paths)], env=gpu_common.child_env())
    while not os.path.exists(paths["bucket"]):
        time.sleep(0.05)
    results = result_channel.ResultFile()
    cons = subprocess.Popen([sys.executable, __file__, "--child", "consumer_of_dead", "--args",
                             json.dumps(paths)], env={**gpu_common.child_env(), **results.env})
    while not os.path.exists(paths["imported"]):
        time.sleep(0.05)
    prod.send_signal(signal.SIGKILL)
    prod.wait(60)
    os.remove(paths["imported"])
    cons.wait(120)
    r = results.take()
    if r is result_channel.NO_RESULT:
        raise RuntimeError(f"consumer_of_dead: no result (rc {cons.returncode})")
    time.sleep(0.5)
    r["device_held_mib"] = (used(torch) - base) / MIB
    ok = (r["bad"] == 0 and r["imports_before_drop"] == N and r["left"]["imports_live"] == 0
          and r["device_held_mib"] <= 2)
    return ok, r


def check_queue():
    r = run_child("queue")
    ok = (r["bad"] == 0 and r["registered"] and r["receiver_exit"] == 0 and r["held_mib"] <= 2
          and all(v == 0 for v in r["left"].values()) and "unshared" in r["early_error"])
    return ok, r


CHECKS = {"receiver_killed": check_receiver_killed, "sender_killed": check_sender_killed,
          "queue": check_queue}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--child")
    p.add_argument("--args", default="{}")
    a = p.parse_args()
    if a.child:
        CHILDREN[a.child](json.loads(a.args))
        return 0
    failed = 0
    for name in a.only.split(","):
        try:
            ok, r = CHECKS[name]()
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            ok, r = False, f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{name}: {'PASS' if ok else 'FAIL'} {r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
