"""Helpers for test_ipc_torch_sim.py that must be importable by a spawned process."""

from __future__ import annotations

import gc


def consumer(q_in, q_out) -> None:
    """torch.multiprocessing target: open every Share from q_in, report its values, write
    into it, then close (explicitly or by dropping it) and report the live imports."""
    import gpu_arena

    while True:
        item = q_in.get()
        if item is None:
            break
        share, how = item
        t = gpu_arena.open(share)
        values = t.tolist()
        t.fill_(-7)
        live = gpu_arena.imports_live()
        if how == "close":
            gpu_arena.close(t)
        else:
            del t
            gc.collect()
        q_out.put((values, live, gpu_arena.imports_live()))
