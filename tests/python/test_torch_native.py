"""gpu_arena.torch_native without torch: the shipped sources, where CUDA's headers are found,
the torch version read from headers, the build's refusals. (Compiling against torch's headers
and running the allocator over the sim backend: scripts/check-torch-native.sh.)"""

from __future__ import annotations

import types
from pathlib import Path

from gpu_arena import torch_native as tn


def test_sources_are_shipped():
    # The wheel carries the C++ it compiles at install time.
    assert tn.SOURCE.is_file() and tn.SOURCE.name == "allocator.cpp"
    assert all(h.is_file() for h in tn.HEADERS)
    assert tn.INSTALL_FN in tn.SOURCE.read_text()


def _include(root: Path, name: str, version=None, crt=False) -> Path:
    d = root / name / "include"
    d.mkdir(parents=True)
    if version is not None:
        (d / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
    if crt:
        (d / "crt").mkdir()
        (d / "crt" / "host_config.h").write_text("")
    return d


def _torch(cuda="13.0", version="2.11.0+cu130"):
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda))


def test_cuda_headers_of_torchs_major_first(tmp_path):
    cuda12 = _include(tmp_path, "cuda12", 12080, crt=True)
    cuda13 = _include(tmp_path, "cuda13", 13000, crt=True)
    assert tn.find_cuda_includes(_torch("13.0"), [cuda12, cuda13]) == ([cuda13], "")
    assert tn.find_cuda_includes(_torch("12.8"), [cuda13, cuda12]) == ([cuda12], "")


def test_cuda_runtime_and_crt_from_two_pip_packages(tmp_path):
    runtime = _include(tmp_path, "runtime", 13000)
    crt = _include(tmp_path, "crt", crt=True)
    assert tn.find_cuda_includes(_torch(), [runtime, crt]) == ([runtime, crt], "")
    dirs, why = tn.find_cuda_includes(_torch(), [runtime])
    assert dirs == [] and "crt/host_config.h" in why
    dirs, why = tn.find_cuda_includes(_torch(), [])
    assert dirs == [] and "cuda_runtime_api.h" in why


def test_torch_version_from_headers(tmp_path):
    h = tmp_path / "torch" / "headeronly"
    h.mkdir(parents=True)
    (h / "version.h").write_text("#define TORCH_VERSION_MAJOR 2\n#define TORCH_VERSION_MINOR 15\n")
    assert tn.headers_version([tmp_path]) == (2, 15)
    assert tn.headers_version([tmp_path / "none"]) is None
    assert tn.cxx_std((2, 15)) == "c++20" and tn.cxx_std((2, 11)) == "c++17"
    ok, why = tn.check_headers([tmp_path / "none"])
    assert not ok and "version.h" in why


def test_build_refuses_old_or_cpu_only_torch():
    path, why = tn.build(_torch(version="2.7.1"))
    assert path is None and "older than 2.8" in why
    path, why = tn.build(_torch(cuda=None))
    assert path is None and "without CUDA" in why


def _fake_compiler(d: Path, name: str, runtime: Path) -> Path:
    exe = d / name
    exe.write_text(f"#!/bin/sh\necho {runtime}\n")
    exe.chmod(0o755)
    return exe


def test_the_compiler_whose_cxx_runtime_torch_loaded_is_chosen(tmp_path, monkeypatch):
    from gpu_arena import _cxx

    ours, theirs = tmp_path / "libstdc++.so.6", tmp_path / "opt-libstdc++.so.6"
    ours.write_text("")
    theirs.write_text("")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    newer = _fake_compiler(bindir, "opt-g++", theirs)
    system = _fake_compiler(bindir, "c++", ours)
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv("CXX", str(newer))
    monkeypatch.delenv("GPU_ARENA_CXX", raising=False)
    monkeypatch.setattr(_cxx, "loaded_libstdcxx", lambda: str(ours))
    # $CXX links another C++ runtime than the process's: the system compiler is taken.
    assert _cxx.compiler() == str(system)
    # No runtime loaded yet (a headers-only check): $CXX first.
    monkeypatch.setattr(_cxx, "loaded_libstdcxx", lambda: None)
    assert _cxx.compiler() == str(newer)
    # GPU_ARENA_CXX is used as it is.
    monkeypatch.setenv("GPU_ARENA_CXX", str(newer))
    monkeypatch.setattr(_cxx, "loaded_libstdcxx", lambda: str(ours))
    assert _cxx.compiler() == str(newer)
    assert tn.compiler() == str(newer)


def test_an_object_with_a_private_cxx_runtime_is_found(tmp_path):
    # What /opt/gcc on the H200 image did: -static-libstdc++ / -static-libgcc in the object.
    import shutil
    import subprocess

    from gpu_arena import _cxx

    cxx = shutil.which("c++")
    if cxx is None or shutil.which("nm") is None:
        import pytest

        pytest.skip("no c++ or nm")
    src = tmp_path / "t.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void f() { throw std::runtime_error("x"); }\n')
    shared, static = tmp_path / "shared.so", tmp_path / "static.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(shared)], check=True)
    subprocess.run([cxx, "-shared", "-fPIC", "-static-libstdc++", "-static-libgcc", str(src),
                    "-o", str(static)], check=True)
    assert _cxx.private_runtime(str(shared)) is None
    assert _cxx.private_runtime(str(static)) in _cxx.RUNTIME_SYMBOLS
