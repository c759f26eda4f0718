"""Sharing across real processes through the Python binding, on the sim backend (no torch,
no GPU: runs in CI).

gpu-arena's init is process-global, so the producer and the consumer are each a fresh
subprocess (tests/python/ipc_worker.py) driven over stdin, answering on a reply pipe of its
own (result_channel.py); share handles travel between them as
hex text, as they would over any byte channel. Sim pointers are host memory, so the
processes read and write them with ctypes.memmove.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

os.environ["GPU_ARENA_BACKEND"] = "sim"  # the workers inherit it

import pytest  # noqa: E402
from conftest import INSTALLED, child_env  # noqa: E402
from result_channel import ReplyPipe  # noqa: E402

import gpu_arena  # noqa: E402
from gpu_arena import _lib  # noqa: E402
from gpu_arena.handle import _layout  # noqa: E402

WORKER = Path(__file__).resolve().parent / "ipc_worker.py"
CONF = "backend=sim,arena_size=64MiB,sim_capacity=4GiB"
MiB = 1 << 20
ERR_IPC = gpu_arena.GPU_ARENA_ERR_IPC
ERR_UNKNOWN_POINTER = gpu_arena.GPU_ARENA_ERR_UNKNOWN_POINTER
ERR_INVALID_ARGUMENT = gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT


def _has_ipc() -> bool:
    try:
        return _lib.has_ipc()
    except gpu_arena.LibraryNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    not _has_ipc(), reason="libgpu_arena.so has no IPC functions (rebuild it)"
)


class WorkerError(Exception):
    def __init__(self, code, message):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class Worker:
    """A gpu-arena process answering JSON requests (tests/python/ipc_worker.py) on a reply
    pipe; its stdout and stderr go to a log file, read for error messages."""

    def __init__(self, conf: str = CONF, timeout: float = 10.0):
        self.replies = ReplyPipe()
        self.log = tempfile.TemporaryFile("w+")
        self.timeout = timeout
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), conf],
                stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                text=True, bufsize=1, env=child_env(self.replies.env),
                pass_fds=(self.replies.fd,),
            )
        finally:
            self.replies.started()
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        first = self._line()
        assert first.startswith("READY "), first
        _, pid, package = first.split(maxsplit=2)
        self.pid = int(pid)
        if INSTALLED:  # the worker's package is the installed one too
            assert Path(package).resolve().is_relative_to(Path(sys.prefix).resolve()), package

    def _pump(self):
        for line in self.replies.reader:
            self.lines.put(line)
        self.lines.put(None)

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def _line(self) -> str:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"worker {self.proc.pid} did not answer within {self.timeout} s")
        if line is None:
            err = self._log() if self.proc.poll() is not None else ""
            raise AssertionError(f"worker {self.proc.pid} exited ({self.proc.poll()}): {err}")
        return line.strip()

    def __call__(self, op: str, **args):
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line())
        if "error" in reply:
            raise WorkerError(reply["error"], reply["message"])
        return reply["ok"]

    def error_of(self, op: str, **args) -> WorkerError:
        with pytest.raises(WorkerError) as e:
            self(op, **args)
        return e.value

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self("exit")
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.replies.reader, self.log):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def pair():
    producer, consumer = Worker(), Worker()
    yield producer, consumer
    consumer.close()
    producer.close()


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def flip(handle_hex: str, at: int) -> str:
    b = bytearray.fromhex(handle_hex)
    b[at] ^= 0xFF
    return b.hex()


# ----------------------------------------------------------------------------------------


def test_share_import_read_write_close(pair):
    producer, consumer = pair
    n = 4 * MiB
    p = producer("malloc", n=n)
    data = pattern(4096, 7)
    producer("write", ptr=p + MiB, hex=data.hex())
    h = producer("share", ptr=p + MiB, n=2 * MiB)
    handle = gpu_arena.ShareHandle.from_hex(h)
    assert (handle.producer_pid, handle.length, handle.device) == (producer.pid, 2 * MiB, 0)
    s = producer("stats")
    assert (s["shares_live"], s["exports_live"], s["imports_live"]) == (1, 1, 0)

    q = consumer("import", handle=h)
    assert consumer("read", ptr=q, n=4096) == data.hex(), "the consumer reads the producer's bytes"
    consumer("write", ptr=q + 100, hex="c0ffee")
    assert producer("read", ptr=p + MiB + 100, n=3) == "c0ffee", "the producer sees the write"
    assert consumer("imports_live") == 1
    assert producer("stats")["imports_live"] == 1

    consumer("close", ptr=q)
    assert consumer("imports_live") == 0
    assert producer("wait_stats", key="imports_live", value=0, timeout=2) < 2
    producer("unshare", handles=[h])
    producer("free", ptr=p, n=n)
    producer("empty_cache")
    s = producer("stats")
    assert (s["shares_live"], s["exports_live"], s["reserved_bytes"]) == (0, 0, 0)
    producer("validate")


def test_second_share_of_an_arena_reuses_the_export_and_the_mapping(pair):
    producer, consumer = pair
    p = producer("malloc", n=MiB)
    h1 = producer("share", ptr=p, n=4096)
    h2 = producer("share", ptr=p + 8192, n=4096)
    assert producer("stats")["exports_total"] == 1, "one export per arena"
    q1 = consumer("import", handle=h1)
    q2 = consumer("import", handle=h2)
    assert q2 - q1 == 8192, "both imports lie in one mapping of the arena"
    consumer("close", ptr=q1)
    consumer("close", ptr=q2)
    producer("unshare", handles=[h1, h2])
    producer("free", ptr=p, n=MiB)


def test_batch_share_import_close(pair):
    producer, consumer = pair
    p = producer("malloc", n=8 * MiB)
    hs = producer("share_batch", ptrs=[p + i * MiB for i in range(8)], sizes=[MiB] * 8)
    assert len(hs) == 8 and producer("stats")["shares_live"] == 8
    qs = consumer("import_batch", handles=hs)
    assert [q - qs[0] for q in qs] == [i * MiB for i in range(8)]
    assert consumer("imports_live") == 8
    # a range past its allocation: nothing is shared
    with pytest.raises(WorkerError) as e:
        producer("share_batch", ptrs=[p, p + 7 * MiB], sizes=[MiB, 2 * MiB])
    assert e.value.code == ERR_INVALID_ARGUMENT
    assert producer("stats")["shares_live"] == 8
    # an unknown pointer: nothing is closed
    with pytest.raises(WorkerError) as e:
        consumer("close_batch", ptrs=[qs[0], 12345])
    assert e.value.code == ERR_UNKNOWN_POINTER
    assert consumer("imports_live") == 8
    # a revoked share: nothing is imported
    producer("unshare", handles=[hs[7]])
    with pytest.raises(WorkerError) as e:
        consumer("import_batch", handles=hs[4:])
    assert e.value.code == ERR_IPC
    assert consumer("imports_live") == 8
    consumer("close_batch", ptrs=qs)
    assert consumer("imports_live") == 0
    assert producer("wait_stats", key="imports_live", value=0, timeout=2) < 2
    producer("unshare", handles=hs[:7])
    producer("free", ptr=p, n=8 * MiB)


def test_bad_handles_and_misuse_give_the_right_codes(pair):
    producer, consumer = pair
    p = producer("malloc", n=MiB)
    producer("write", ptr=p, hex="5a" * 16)
    h = producer("share", ptr=p, n=MiB)

    # A forged token: the broker refuses it.
    layout = _layout()  # the library's (gpu_arena_share_layout)
    token_at, token_len = layout["token"]
    for at in (token_at, token_at + 7, token_at + token_len - 1):
        e = consumer.error_of("import", handle=flip(h, at))
        assert e.code == ERR_IPC, e
    # A handle of another version: refused before any connection.
    e = consumer.error_of("import", handle=flip(h, layout["version"][0]))
    assert e.code == ERR_IPC and "version" in e.message, e
    # Bad magic, truncated handle.
    assert consumer.error_of("import", handle=flip(h, layout["magic"][0])).code == ERR_IPC
    assert consumer.error_of("import", handle=h[:200]).code == "python"  # ValueError: 100 bytes

    # Out-of-bounds and foreign shares in the producer.
    e = producer.error_of("share", ptr=p, n=MiB + 4096)
    assert e.code == ERR_INVALID_ARGUMENT and "runs past" in e.message, e
    assert producer.error_of("share", ptr=p + 2 * MiB, n=4096).code == ERR_UNKNOWN_POINTER
    assert producer.error_of("share", ptr=p, n=0).code == ERR_INVALID_ARGUMENT

    # Double close.
    q = consumer("import", handle=h)
    assert consumer("read", ptr=q, n=16) == "5a" * 16
    consumer("close", ptr=q)
    e = consumer.error_of("close", ptr=q)
    assert e.code == ERR_UNKNOWN_POINTER, e
    assert consumer.error_of("close", ptr=12345).code == ERR_UNKNOWN_POINTER

    # Import after unshare; a second unshare.
    producer("unshare", handles=[h])
    e = consumer.error_of("import", handle=h)
    assert e.code == ERR_IPC, e
    assert producer.error_of("unshare", handles=[h]).code == ERR_IPC
    assert consumer("imports_live") == 0
    producer("free", ptr=p, n=MiB)
    producer("empty_cache")
    assert producer("stats")["reserved_bytes"] == 0


def test_import_from_a_dead_producer_is_an_ipc_error(pair):
    producer, consumer = pair
    p = producer("malloc", n=MiB)
    h = producer("share", ptr=p, n=MiB)
    producer.kill()
    e = consumer.error_of("import", handle=h)
    assert e.code == ERR_IPC, e


def test_imports_survive_the_producer_being_killed(pair):
    producer, consumer = pair
    p = producer("malloc", n=MiB)
    data = pattern(1024, 3)
    producer("write", ptr=p, hex=data.hex())
    h = producer("share", ptr=p, n=MiB)
    q = consumer("import", handle=h)
    producer.kill()
    assert consumer("read", ptr=q, n=1024) == data.hex(), "the mapping outlives its producer"
    consumer("close", ptr=q)
    assert consumer("imports_live") == 0


def test_sigkilled_consumer_gives_its_imports_back(pair):
    producer, consumer = pair
    count, size = 100, 64 * 1024
    n = count * size
    p = producer("malloc", n=n)
    handles = producer("share_many", ptr=p, size=size, count=count)
    ptrs = consumer("import_many", handles=handles)
    assert len(set(ptrs)) == count
    assert consumer("imports_live") == count
    s = producer("stats")
    assert (s["imports_live"], s["shares_live"]) == (count, count)

    consumer.kill(signal.SIGKILL)
    took = producer("wait_stats", key="imports_live", value=0, timeout=1.0)
    assert took < 1.0
    producer("unshare", handles=handles)
    producer("free", ptr=p, n=n)
    producer("empty_cache")
    s = producer("stats")
    assert (s["reserved_bytes"], s["shares_live"], s["exports_live"], s["arenas"]) == (0, 0, 0, 0)
    producer("validate")


def test_freeing_while_shared_defers_until_the_last_import_closes(pair):
    producer, consumer = pair
    p = producer("malloc", n=MiB)
    producer("write", ptr=p, hex="ab" * 8)
    h = producer("share", ptr=p, n=MiB)
    q = consumer("import", handle=h)
    producer("free", ptr=p, n=MiB)
    producer("unshare", handles=[h])
    producer("empty_cache")
    assert producer("stats")["reserved_bytes"] > 0, "still imported: the arena stays"
    assert consumer("read", ptr=q, n=8) == "ab" * 8
    consumer("close", ptr=q)
    producer("wait_stats", key="imports_live", value=0, timeout=2)
    producer("empty_cache")
    assert producer("stats")["reserved_bytes"] == 0


# ----------------------------------------------------------------------------------------
# In this process: the Python API's own checks (no second process needed)
# ----------------------------------------------------------------------------------------


def test_share_handle_type():
    raw = bytes(range(128))
    h = gpu_arena.ShareHandle(raw)
    assert isinstance(h, bytes) and h == raw and h.to_bytes() == raw
    assert gpu_arena.ShareHandle.from_hex(raw.hex()) == h
    import pickle

    h2 = pickle.loads(pickle.dumps(h))
    assert type(h2) is gpu_arena.ShareHandle and h2 == h
    with pytest.raises(ValueError):
        gpu_arena.ShareHandle(b"x" * 127)
    with pytest.raises(TypeError):
        gpu_arena.ShareHandle("00" * 128)
    assert "not a gpu-arena handle" in repr(h)


def test_share_object_round_trips_without_torch():
    h = bytearray(128)
    h[:8] = b"GPUARENA"
    h[48:56] = (4096).to_bytes(8, "little")
    s = gpu_arena.Share(bytes(h), "torch.bfloat16", (2, 3), (3, 1), 5, 1, 4096)
    assert s.dtype == "bfloat16" and not s.owner
    s2 = gpu_arena.Share.from_bytes(s.to_bytes())
    assert (s2.handle, s2.dtype, s2.shape, s2.stride, s2.storage_offset, s2.device, s2.nbytes) \
        == (s.handle, "bfloat16", (2, 3), (3, 1), 5, 1, 4096)
    assert gpu_arena.Share.from_base64(s.to_base64()).to_bytes() == s.to_bytes()
    import pickle

    s3 = pickle.loads(pickle.dumps(s))
    assert s3.to_bytes() == s.to_bytes()
    with pytest.raises(ValueError):
        gpu_arena.Share.from_bytes(b"GASHARE1" + bytes(h) + b"{not json")
    with pytest.raises(ValueError):
        gpu_arena.Share.from_bytes(b"nope")
