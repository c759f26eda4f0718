"""The package under test is the installed wheel, when scripts/test.sh says so.

scripts/test.sh builds the wheel (scripts/build-wheel.sh), installs it in a fresh venv and
runs these suites there with ``GPU_ARENA_EXPECT_INSTALLED=1``, ``GPU_ARENA_LIB`` unset and
python/ off the path. This checks that nothing of the checkout leaked in: the package, its
library and a child process's package all come from the venv, and cffi (which maturin uses
to build the wheel) is not needed to run it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from conftest import INSTALLED, PYTHON_DIR, result_of, run_python

import gpu_arena
from gpu_arena import _lib

pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="GPU_ARENA_EXPECT_INSTALLED=1 not set: testing the checkout's package"
)


def inside(path: str, folder: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def test_package_and_library_come_from_the_venv():
    assert sys.prefix != sys.base_prefix, "not running in a venv"
    assert "GPU_ARENA_LIB" not in os.environ
    assert str(PYTHON_DIR) not in sys.path
    assert inside(gpu_arena.__file__, sys.prefix), gpu_arena.__file__
    assert not _lib.in_checkout()
    assert gpu_arena.lib_path() == str(_lib.packaged_path().resolve())
    assert inside(gpu_arena.lib_path(), sys.prefix)


def test_child_process_imports_the_installed_package():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        report([gpu_arena.__file__, gpu_arena.lib_path()])
        """,
        env={"GPU_ARENA_BACKEND": "sim"},
    )
    pkg, lib = result_of(proc)
    assert inside(pkg, sys.prefix) and inside(lib, sys.prefix), (pkg, lib)


def test_no_runtime_dependency():
    requires = importlib.metadata.requires("gpu-arena") or []
    assert all("extra ==" in r for r in requires), requires
    # The wheel's gpu_arena/_native/ holds maturin's cffi wrapper, never imported: the library
    # loads without cffi.
    assert importlib.util.find_spec("cffi") is None
    assert os.path.isfile(gpu_arena.lib_path())  # loads it
