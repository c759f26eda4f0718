"""Shared helpers: which package is tested, and running snippets in a fresh process
(gpu-arena's init is process-global) with ``sys.executable``.

By default the package is imported from this checkout (python/ goes first on sys.path, no
install needed) with the newest cargo build. With ``GPU_ARENA_EXPECT_INSTALLED=1``
(scripts/test.sh, which runs the suites in a fresh venv holding the wheel) the package is the
installed one, with its packaged library: python/ is not put on the path, here or in child
processes, and ``GPU_ARENA_LIB`` is left alone (test_install.py checks all that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

# tests/python/conftest.py -> the repository root; the package lives in python/.
REPO_DIR = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO_DIR / "python"

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
    os.environ, names in `drop` removed, `env` added, and (unless INSTALLED) this checkout's
    python/ first on PYTHONPATH."""
    e = dict(os.environ)
    for name in drop:
        e.pop(name, None)
    e.update(env or {})
    if not INSTALLED:
        e["PYTHONPATH"] = str(PYTHON_DIR) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run_python(code: str, env: dict | None = None, drop=(), timeout: float = 300):
    """Run `code` in a fresh interpreter that imports the package under test.

    `env` and `drop` as for `child_env`. Returns the CompletedProcess; a snippet reports
    results by printing one JSON line prefixed with ``RESULT=``, which `result_of` parses."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(env, drop),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def result_of(proc) -> dict:
    """The RESULT= JSON a snippet printed; fails the test with its output otherwise."""
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT="):])
    raise AssertionError(
        f"subprocess exited {proc.returncode} without RESULT=\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
