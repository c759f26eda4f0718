"""A child process's own channel back to the test that started it (both sides; stdlib only).

A child's stdout and stderr are not its own: libraries in it write there too, from threads of
their own (UCX prints its protocol tables to stdout under ``UCX_PROTO_INFO=y``, gpu-arena logs
to stderr), and on a busy machine a line the child prints can be spliced into one of theirs
(``[1RESULT={...}`` inside a table row). So a child never hands its result back there; its
stdout and stderr stay a log, captured for the error messages. Instead:

* One result, at the end: the parent names a file in ``$GPU_ARENA_TEST_RESULT`` (in a fresh
  temporary folder, `ResultFile`); the child's `report(value)` writes it as JSON to a temporary
  file beside it and renames it into place, so the parent reads all of it or nothing.
* A conversation (one answer per request): the parent makes a pipe (`ReplyPipe`), passes its
  write end with ``pass_fds`` and names it in ``$GPU_ARENA_TEST_REPLY_FD``; the child answers on
  `reply_stream()`, which only it writes.

`run_reporting` runs a child to its end with a result file; tests/python/conftest.py's
`run_python` / `start_python` do the same for snippets of Python.

Children import this module by name: conftest.child_env puts tests/python on their path,
tests/python/ipc_worker.py sits beside it, and the GPU scripts (tests/gpu/, bench/gpu/) import
tests/gpu/gpu_common.py, which puts it on their path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

RESULT_ENV = "GPU_ARENA_TEST_RESULT"
REPLY_FD_ENV = "GPU_ARENA_TEST_REPLY_FD"
HERE = os.path.dirname(os.path.abspath(__file__))

# --- the child's side -------------------------------------------------------------------


def report(value, default=None) -> None:
    """Hand `value` (JSON; `default` as for json.dump) back as this process's result: written
    to a temporary file, then renamed to the path in $GPU_ARENA_TEST_RESULT."""
    path = os.environ[RESULT_ENV]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, default=default)
    os.replace(tmp, path)


def reply_stream(binary: bool = False):
    """The write end of the parent's reply pipe ($GPU_ARENA_TEST_REPLY_FD): text and line
    buffered, or binary (flush after each answer)."""
    fd = int(os.environ[REPLY_FD_ENV])
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", buffering=1)


# --- the parent's side ------------------------------------------------------------------


class _NoResult:
    def __repr__(self) -> str:
        return "NO_RESULT"


NO_RESULT = _NoResult()
"""What `ResultFile.take` returns when the child reported nothing."""


class ResultFile:
    """Where one child reports (`report`): result.json in a fresh temporary folder. Put `env`
    in the child's environment; `take()` once it has exited."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="gpu-arena-result-")
        self.path = os.path.join(self.dir, "result.json")
        self.env = {RESULT_ENV: self.path}

    def take(self):
        """The value the child reported, or NO_RESULT; removes the folder."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return NO_RESULT
        finally:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class ReplyPipe:
    """A pipe one child answers on (`reply_stream`). Start the child with ``pass_fds=(p.fd,)``
    and `env` in its environment, then call `started()` (this process's copy of the write end
    closes, so the child's exit reads as end of file on `reader`)."""

    def __init__(self, binary: bool = False):
        r, w = os.pipe()
        self.fd = w
        self.env = {REPLY_FD_ENV: str(w)}
        self.reader = os.fdopen(r, "rb" if binary else "r")

    def started(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.started()
        self.reader.close()


def run_reporting(cmd, env=None, timeout=None, **kw):
    """Run `cmd` to its end with a fresh `ResultFile` in its environment (`env`, default
    os.environ, plus $GPU_ARENA_TEST_RESULT), stdout and stderr captured as text. Returns
    (the value it reported or NO_RESULT, the CompletedProcess). Past `timeout`,
    subprocess.TimeoutExpired, as subprocess.run raises it."""
    results = ResultFile()
    try:
        proc = subprocess.run(cmd, env={**(os.environ if env is None else env), **results.env},
                              capture_output=True, text=True, timeout=timeout, **kw)
        return results.take(), proc
    finally:
        results.discard()
