import faulthandler, sys
faulthandler.enable()
import gpu_common  # noqa: F401,E402  (beside this file: python/ on sys.path)
import gpu_arena.torch as gt
gt.install(route=sys.argv[1] if len(sys.argv) > 1 else "native")
import torch
print("route", gt.route_in_use(), flush=True)
x = torch.empty(1 << 20, device="cuda"); print("alloc ok", flush=True)
try:
    t = torch.empty(400 << 30, dtype=torch.uint8, device="cuda")
except Exception as e:
    print("exc", type(e), str(e)[:300], flush=True)
print("done", flush=True)
