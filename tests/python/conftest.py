"""Shared helpers: which package is tested, and running snippets in a fresh process
(gpu-arena's init is process-global) with ``sys.executable``.

By default the package is imported from this checkout (python/ goes first on sys.path, no
install needed) with the newest cargo build. With ``GPU_ARENA_EXPECT_INSTALLED=1``
(scripts/test.sh, which runs the suites in a fresh venv holding the wheel) the package is the
installed one, with its packaged library: python/ is not put on the path, here or in child
processes, and ``GPU_ARENA_LIB`` is left alone (test_install.py checks all that).

A child hands its result back on a channel of its own (result_channel.py: a result file, or a
reply pipe), never on its stdout or stderr, which libraries write to as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from result_channel import NO_RESULT, ResultFile

# tests/python/conftest.py -> the repository root; the package lives in python/.
REPO_DIR = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO_DIR / "python"
TESTS_DIR = Path(__file__).resolve().parent  # children import result_channel from here

INSTALLED = os.environ.get("GPU_ARENA_EXPECT_INSTALLED") == "1"

if not INSTALLED and str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))


def _newest_build() -> None:
    """Without GPU_ARENA_LIB the package prefers target/release over target/debug, so a
    stale release build would shadow the debug build just made: test the newest build that
    exists instead (subprocesses inherit the choice)."""
    if INSTALLED or os.environ.get("GPU_ARENA_LIB"):
        return
    from gpu_arena import _lib

    builds = [p for p in _lib.candidate_paths() if p.is_file()]
    if builds:
        os.environ["GPU_ARENA_LIB"] = str(max(builds, key=lambda p: p.stat().st_mtime))


_newest_build()


def child_env(env: dict | None = None, drop=()) -> dict:
    """The environment of a child interpreter that imports the package under test: a copy of
    os.environ without the caller's GPU_ARENA_CONF (a test's child configures gpu-arena
    itself: a configuration of the shell running pytest, say grow_arenas=1, must not change
    what a test expects; GPU tests pass `gpu_check_env()`), names in `drop` removed, `env`
    added, (unless INSTALLED) this checkout's python/ first on PYTHONPATH and tests/python
    (result_channel) last."""
    e = dict(os.environ)
    for name in ("GPU_ARENA_CONF", *drop):
        e.pop(name, None)
    e.update(env or {})
    path = [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not INSTALLED:
        path.insert(0, str(PYTHON_DIR))
    e["PYTHONPATH"] = os.pathsep.join(path + [str(TESTS_DIR)])
    return e


def gpu_check_env() -> dict:
    """For a GPU test's child, which drops the caller's GPU_ARENA_CONF: GPU_ARENA_CHECK_CONF as
    its GPU_ARENA_CONF when set (tests/gpu/gpu_common.py: the configuration a whole GPU check
    runs on, e.g. grow_arenas=1), else nothing."""
    conf = os.environ.get("GPU_ARENA_CHECK_CONF")
    return {"GPU_ARENA_CONF": conf} if conf else {}


def start_python(code: str, args=(), env: dict | None = None, drop=(), **popen):
    """Start `code` in a fresh interpreter that imports the package under test, with
    `args` as sys.argv[1:], `env` and `drop` as for `child_env`, stdout and stderr piped
    (text) and a `ResultFile` for its result: the snippet calls
    ``result_channel.report(value)``. `popen`: more subprocess.Popen arguments (stdin,
    pass_fds, ...). Wait for it with `finish`."""
    results = ResultFile()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
            env=child_env({**(env or {}), **results.env}, drop),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
    except BaseException:
        results.discard()
        raise
    proc.results = results
    return proc


def finish(proc, input: str | None = None, timeout: float = 300):
    """Wait for a `start_python` child (past `timeout` it is killed and TimeoutExpired
    raised, as subprocess.run does). Returns its CompletedProcess, with `result`: the value
    it reported, or NO_RESULT (`result_of` reads it)."""
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        proc.results.discard()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.result = proc.results.take()
    return done


def run_python(code: str, env: dict | None = None, drop=(), timeout: float = 300, args=()):
    """Run `code` as `start_python` does and wait for it (`finish`): the CompletedProcess,
    with the reported value in `result`."""
    return finish(start_python(code, args, env, drop), timeout=timeout)


def result_of(proc):
    """The value a snippet reported (`finish`); fails the test with its output otherwise."""
    if proc.result is NO_RESULT:
        raise AssertionError(
            f"subprocess exited {proc.returncode} without reporting a result\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc.result
