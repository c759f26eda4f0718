"""Sharing gpu-arena memory between processes (C: ``gpu_arena_share`` / ``unshare`` /
``import`` / ``close``, ffi/src/ipc_api.rs).

Two levels.

**Pointers** (no PyTorch needed)::

    # producer                                   # consumer
    h = gpu_arena.share_ptr(ptr, nbytes)         p = gpu_arena.import_handle(h)
    send(bytes(h))        ------------------>    ...use [p, p + nbytes)...
    ...                                          gpu_arena.close_import(p)
    gpu_arena.unshare(h)

The batch calls ``share_ptrs(ptrs, sizes)`` / ``import_handles(handles)`` /
``close_imports(ptrs)`` do the same for many ranges in one call each.

A :class:`ShareHandle` is 128 plain bytes (a ``bytes`` subclass): no pointer, no fd. It
travels any way bytes travel (pickle, a pipe, HTTP). ``import_handle`` connects to the
producer's broker (a Unix socket; only the producer's uid is accepted by default), receives
the arena's export once per arena, maps it, and returns the address of the share's first
byte. Every ``import_handle`` must be matched by one ``close_import`` (a second close of the
same pointer raises ``UnknownPointerError``). ``unshare`` stops new imports; imports already
made stay valid until their consumers close them (or die: a killed consumer's imports end
when the kernel closes its socket), and the memory is reused only after that.

**Tensors** (PyTorch)::

    # producer                                   # consumer
    s = gpu_arena.share(kv)  # -> Share          t = gpu_arena.open(s)   # a tensor, no copy
    queue.put(s)   (or s.to_bytes())  ------>    ...use t...
    ...                                          gpu_arena.close(t)      # or just drop t
    s.close()                # unshare

``share(tensor)`` shares the tensor's whole untyped storage ``[storage.data_ptr(),
+storage.nbytes())``, so views and storage offsets survive; the :class:`Share` it returns
pickles to the 128 handle bytes plus dtype, shape, stride, storage offset and device, and
``Share.to_bytes()`` / ``Share.from_bytes()`` carry the same through anything else. Only the
producer's own ``Share`` object (the one ``share()`` returned) unshares on ``close()``: it is
not closed when it is garbage-collected (a share handed to a queue must outlive the local
object), so call ``close()`` (or use ``with``) when the consumers no longer need to import.

``open(share)`` imports the share and returns a tensor over the imported memory (built with
DLPack: ``gpu_arena._dlpack`` says why not ``__cuda_array_interface__``). The import stays
open while any tensor over that memory (the returned tensor or any view of it) is alive, and
is closed automatically when the last one is garbage-collected. ``close(tensor)`` closes it
at once: after that the tensor and every view of it point to unmapped memory and **must not
be used** (on CUDA a kernel touching it raises an illegal-address error that poisons the
CUDA context). Closing (explicitly or by garbage
collection) synchronizes the device first, so work already queued on the tensor finishes
before the memory is unmapped.

Devices: the handle names the producer's device index, and the consumer maps the memory on
the device with the same index in *its* numbering: run producer and consumer with the same
``CUDA_VISIBLE_DEVICES``.

Where it lives: ``gpu_arena.handle`` (:class:`ShareHandle`), ``gpu_arena.pointers`` (the
pointer level), ``gpu_arena.tensors`` (the tensor level; the library builds the DLPack
tensors and keeps the open imports, ffi/src/dlpack_api.rs: ``_imports`` reaches them,
``_dlpack`` hands the tensors to torch). This module is the namespace that gathers them; every name
but the batch calls is also on ``gpu_arena`` itself (``open`` and ``close`` outside its
``__all__``, so that ``from gpu_arena import *`` keeps the builtins).
"""

from __future__ import annotations

from .handle import ShareHandle
from .pointers import (
    close_import,
    close_imports,
    import_handle,
    import_handles,
    imports_live,
    share_ptr,
    share_ptrs,
    unshare,
)
from .tensors import Share, close, open, open_imports, share

__all__ = [
    "ShareHandle",
    "share_ptr",
    "unshare",
    "import_handle",
    "close_import",
    "imports_live",
    "share_ptrs",
    "import_handles",
    "close_imports",
    "Share",
    "share",
    "open",
    "close",
    "open_imports",
]
