"""What the GPU machine offers for sharing VMM memory with UCX/NIXL, measured, not assumed.

UCX's cuda_ipc transport (the one NIXL should use between processes on one node) exports
VMM memory only as a FABRIC handle (uct_cuda_ipc_mem_add_reg: a VMM pointer whose allowed
handle types lack CU_MEM_HANDLE_TYPE_FABRIC is packed as "no IPC" and UCX falls back to a
staged copy); memory from cudaMalloc goes through legacy cudaIpc. This probe prints:

1. the device's handle-type support (POSIX fd, FABRIC) and whether the IMEX channel exists;
2. whether cuMemCreate with POSIX_FD|FABRIC succeeds, and whether a FABRIC export works;
3. for each memory kind (cudaMalloc via torch, VMM POSIX-only, VMM POSIX|FABRIC, gpu-arena)
   a NIXL READ of 256 MiB from a producer process into a consumer process: the bytes are
   verified, the bandwidth reported, and the UCX protocol lines (UCX_PROTO_INFO=y) searched
   for cuda_ipc.

Usage (on the GPU machine, NIXL installed): python3 bench/gpu/vmm_handle_probe.py [--out F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

SIZE = 256 << 20
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))
import gpu_common  # noqa: E402,F401  (tests/gpu/gpu_common.py: python/ and tests/python/ on sys.path)
from naive_export import CUmemAccessDesc, CUmemAllocationProp, CUmemLocation  # noqa: E402  (tests/gpu/: one definition)
import result_channel  # noqa: E402  (tests/python: the consumer's result: a file of its own, not UCX's stdout)


def _nixl_agent():
    from gpu_arena.nixl import import_nixl

    return import_nixl().nixl_agent


def _cuda():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return cu


def _name(cu, rc):
    s = ctypes.c_char_p()
    cu.cuGetErrorName(rc, ctypes.byref(s))
    return (s.value or b"?").decode()


def vmm_alloc(cu, size, handle_types, device=0):
    """cuMemCreate + reserve + map + access; returns (ptr, handle) or raises with the error."""
    prop = CUmemAllocationProp()
    prop.type = 1  # PINNED
    prop.requestedHandleTypes = handle_types
    prop.location = CUmemLocation(1, device)
    prop.allocFlags.gpuDirectRDMACapable = 1
    handle = ctypes.c_ulonglong()
    rc = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    if rc:
        raise RuntimeError(f"cuMemCreate(types={handle_types}): {_name(cu, rc)}")
    ptr = ctypes.c_ulonglong()
    rc = cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    assert rc == 0, _name(cu, rc)
    rc = cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    assert rc == 0, _name(cu, rc)
    desc = CUmemAccessDesc(CUmemLocation(1, device), 3)
    rc = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
    assert rc == 0, _name(cu, rc)
    return ptr.value, handle


def device_facts():
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    cu = _cuda()
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    facts = {}
    for name, attr in [("posix_fd", 103), ("fabric", 128), ("vmm_rdma", 110)]:
        v = ctypes.c_int(-1)
        rc = cu.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
        facts[name] = v.value if rc == 0 else f"error {_name(cu, rc)}"
    chan = "/dev/nvidia-caps-imex-channels"
    facts["imex_channels"] = sorted(os.listdir(chan)) if os.path.isdir(chan) else "absent"
    try:
        ptr, handle = vmm_alloc(cu, 2 << 20, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)
        facts["create_posix_fabric"] = "ok"
        buf = (ctypes.c_ubyte * 64)()
        rc = cu.cuMemExportToShareableHandle(buf, handle, CU_MEM_HANDLE_TYPE_FABRIC, ctypes.c_ulonglong(0))
        facts["export_fabric"] = "ok" if rc == 0 else _name(cu, rc)
    except RuntimeError as e:
        facts["create_posix_fabric"] = str(e)
    return facts


def producer(kind, workdir):
    import torch
    nixl_agent = _nixl_agent()
    if kind == "gpu_arena":
        import gpu_arena.torch as gt

        gt.install()
    torch.cuda.init()
    cu = _cuda()
    keep = None
    if kind == "torch":
        t = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        ptr, keep = t.data_ptr(), t
    elif kind in ("vmm_posix", "vmm_fabric"):
        torch.empty(1, device="cuda")
        types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if kind == "vmm_fabric":
            types |= CU_MEM_HANDLE_TYPE_FABRIC
        ptr, keep = vmm_alloc(cu, SIZE, types)
    elif kind == "gpu_arena":
        t = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        ptr, keep = t.data_ptr(), t
    else:
        raise SystemExit(f"unknown kind {kind}")
    rc = cu.cuMemsetD8_v2(ctypes.c_ulonglong(ptr), ctypes.c_ubyte(0x5A), ctypes.c_size_t(SIZE))
    assert rc == 0, _name(cu, rc)
    torch.cuda.synchronize()
    agent = nixl_agent("producer")
    reg = agent.register_memory([(ptr, SIZE, 0, "")], "VRAM")
    with open(os.path.join(workdir, "meta.tmp"), "wb") as f:
        f.write(json.dumps({"ptr": ptr}).encode() + b"\n" + agent.get_agent_metadata())
    os.rename(os.path.join(workdir, "meta.tmp"), os.path.join(workdir, "meta"))
    done = os.path.join(workdir, "done")
    deadline = time.time() + 90
    while not os.path.exists(done) and time.time() < deadline:
        time.sleep(0.01)
    agent.deregister_memory(reg)
    del keep


def consumer(workdir):
    import torch
    nixl_agent = _nixl_agent()
    meta = os.path.join(workdir, "meta")
    deadline = time.time() + 40
    while not os.path.exists(meta):
        if time.time() > deadline:
            raise SystemExit("consumer: the producer published nothing in 60 s")
        time.sleep(0.01)
    head, blob = open(meta, "rb").read().split(b"\n", 1)
    ptr = json.loads(head)["ptr"]
    dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    agent = nixl_agent("consumer")
    reg = agent.register_memory(dst)
    peer = agent.add_remote_agent(blob)
    local = agent.get_xfer_descs(dst)
    remote = agent.get_xfer_descs([(ptr, SIZE, 0)], "VRAM")
    result = {}
    for rep in range(3):
        handle = agent.initialize_xfer("READ", local, remote, peer)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.perf_counter() - t0 > 30:
                state = "TIMEOUT"
                break
            state = agent.check_xfer_state(handle)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        result[f"gbps_{rep}"] = round(SIZE / dt / 1e9, 2)
        result["state"] = state
    result["verified"] = bool((dst == 0x5A).all().item())
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)
    open(os.path.join(workdir, "done"), "w").close()
    result_channel.report(result)


def run_kind(kind, logdir=None, tag=""):
    env = dict(os.environ, UCX_PROTO_INFO="y")
    with tempfile.TemporaryDirectory() as workdir:
        p = subprocess.Popen([sys.executable, __file__, "--producer", kind, workdir], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            got, c = result_channel.run_reporting([sys.executable, __file__, "--consumer", workdir],
                                                  env=env, timeout=60)
            out, crc = c.stdout + c.stderr, c.returncode
        except subprocess.TimeoutExpired as e:
            got, out, crc = result_channel.NO_RESULT, f"consumer timed out: {(e.stdout or b'')[-3000:]!r}", "timeout"
        try:
            pout, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            pout, _ = p.communicate()
    res = {"kind": kind, "consumer_rc": crc, "producer_rc": p.returncode}
    if logdir:
        open(os.path.join(logdir, f"{kind}{tag}.consumer.log"), "w").write(out)
        open(os.path.join(logdir, f"{kind}{tag}.producer.log"), "w").write(pout)
    if got is not result_channel.NO_RESULT:
        res.update(got)
    proto = [l.strip() for l in out.splitlines() if "cuda_ipc" in l or "cuda_copy" in l or "tcp" in l or "rndv" in l]
    res["cuda_ipc_seen"] = any("cuda_ipc" in l for l in proto)
    res["proto_lines"] = proto[:12]
    if crc or p.returncode:
        res["consumer_tail"] = out[-1500:]
        res["producer_tail"] = pout[-1500:]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--producer", nargs=2)
    ap.add_argument("--consumer")
    ap.add_argument("--out")
    ap.add_argument("--kinds", default="torch,vmm_posix,vmm_fabric,gpu_arena")
    ap.add_argument("--logdir")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if a.producer:
        return producer(*a.producer)
    if a.consumer:
        return consumer(a.consumer)
    report = {"device": device_facts(), "kinds": []}
    print(json.dumps(report["device"]), flush=True)
    for k in a.kinds.split(","):
        report["kinds"].append(run_kind(k, a.logdir, a.tag))
        print(json.dumps(report["kinds"][-1], indent=1), flush=True)
        if a.out:
            open(a.out, "w").write(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
