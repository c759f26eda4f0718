"""The ctypes binding on the sim backend, without torch (runs in CI).

gpu-arena's init is process-global: this module initializes it once in the test process
(the `arena` fixture, sim backend, 2 devices) and runs everything that needs a process
that has not (or has differently) initialized in a subprocess.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import threading

os.environ["GPU_ARENA_BACKEND"] = "sim"  # before gpu_arena loads / initializes

import pytest  # noqa: E402
from conftest import REPO_DIR, result_of, run_python  # noqa: E402

import gpu_arena  # noqa: E402
from gpu_arena import _lib  # noqa: E402

HEADER = REPO_DIR / "ffi" / "include" / "gpu_arena.h"
CONF = "backend=sim,arena_size=64MiB,sim_devices=2,sim_capacity=1GiB,validate=1"
MiB = 1 << 20


@pytest.fixture(scope="module")
def arena():
    """gpu-arena initialized in this process on the sim backend (2 devices, 1 GiB each)."""
    if not gpu_arena.is_initialized():
        gpu_arena.configure(CONF)
        gpu_arena.init()
    assert gpu_arena.backend_name() == "sim"
    return gpu_arena


def assert_error(excinfo, cls, code, *fragments):
    e = excinfo.value
    assert isinstance(e, gpu_arena.GpuArenaError)
    assert isinstance(e, cls), f"{type(e).__name__} is not {cls.__name__}: {e}"
    assert e.code == code, e
    for f in fragments:
        assert f in e.message, f"{f!r} not in {e.message!r}"


# ----------------------------------------------------------------------------------------
# The binding agrees with the generated C header (one definition: the Rust source)
# ----------------------------------------------------------------------------------------


def _header_text() -> str:
    """The generated C header without its comments."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", HEADER.read_text(), flags=re.S)


# The C types of the header, as ctypes.
_CTYPES = {"uint64_t": ctypes.c_uint64, "uint8_t": ctypes.c_uint8, "int32_t": ctypes.c_int32,
           "uint32_t": ctypes.c_uint32, "size_t": ctypes.c_size_t, "void*": ctypes.c_void_p,
           "char": ctypes.c_char, "char*": ctypes.c_char_p,
           # A struct of the header inside another (checked on its own below).
           "gpu_arena_share_t": _lib.GpuArenaShare}


def _header_struct(name: str):
    """The fields of ``typedef struct name { ... } name;`` as (field, ctypes type)."""
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), _header_text(), re.S)
    assert m, f"{name} is not declared in {HEADER}"
    consts = _header_constants()
    fields = []
    for ctype, star, field, count in re.findall(r"(\w+) (\*?)(\w+)(?:\[(\w+)\])?;", m.group(1)):
        t = _CTYPES[ctype + star]
        if count:
            t = t * (int(count) if count.isdigit() else consts[count])
        fields.append((field, t))
    return fields


def _header_constants() -> dict:
    return {n: int(v) for n, v in re.findall(r"#define (GPU_ARENA_\w+) (-?\d+)", _header_text())}


def _same_type(a, b) -> bool:
    if a is b:
        return True
    if issubclass(a, ctypes.Array) or issubclass(b, ctypes.Array):
        return (issubclass(a, ctypes.Array) and issubclass(b, ctypes.Array)
                and a._length_ == b._length_ and a._type_ is b._type_)
    return ctypes.sizeof(a) == ctypes.sizeof(b) and a._type_ == b._type_


@pytest.mark.parametrize("c_name, py_struct", [
    # Built from what the library serves (gpu_arena_stats_fields): the header's is cbindgen's.
    ("gpu_arena_stats_t", gpu_arena.GpuArenaStats),
    ("gpu_arena_stats_field_t", _lib.GpuArenaStatsField),
    ("gpu_arena_config_key_t", _lib.GpuArenaConfigKey),
    ("gpu_arena_share_t", _lib.GpuArenaShare),
    ("gpu_arena_share_field_t", _lib.GpuArenaShareField),
    ("gpu_arena_share_fields_t", _lib.GpuArenaShareFields),
    ("gpu_arena_arena_info_t", _lib.GpuArenaArenaInfo),
    ("gpu_arena_dlpack_t", _lib.GpuArenaDlpack),
    ("gpu_arena_dlpack_import_t", _lib.GpuArenaDlpackImport),
    ("gpu_arena_xfer_desc_t", _lib.GpuArenaXferDesc),
    ("gpu_arena_xfer_stats_t", _lib.GpuArenaXferStats),
])
@pytest.mark.skipif(not HEADER.exists(), reason="ffi/include/gpu_arena.h not in this checkout")
def test_structs_match_the_header(c_name, py_struct):
    want = _header_struct(c_name)
    have = list(py_struct._fields_)
    assert [n for n, _ in have] == [n for n, _ in want], f"{c_name}: field names or order"
    for (n, a), (_, b) in zip(have, want):
        assert _same_type(a, b), f"{c_name}.{n}: ctypes {a.__name__}, header {b.__name__}"
    assert ctypes.sizeof(py_struct) == sum(ctypes.sizeof(t) for _, t in want)


@pytest.mark.skipif(not HEADER.exists(), reason="ffi/include/gpu_arena.h not in this checkout")
def test_constants_match_the_header():
    consts = _header_constants()
    assert consts, "no GPU_ARENA_ constants found"
    for name, value in consts.items():
        if name == "GPU_ARENA_SHARE_BYTES":
            assert _lib.SHARE_BYTES == value
        else:
            assert getattr(_lib, name) == value, name
    errors = {v for n, v in consts.items() if n.startswith("GPU_ARENA_ERR_")}
    assert set(_lib.ERROR_NAMES) == errors
    assert set(_lib._CLASS_OF_CODE) == errors, "every error code has its exception class"


def test_served_tables_are_the_generated_docs():
    """The library's tables (gpu_arena_config_keys, gpu_arena_stats_fields) are the rows of
    the docs generated from the same Rust tables (alloc/tests/generated_docs.rs)."""
    def rows(doc, n):
        return [tuple(c.strip() for c in line.strip().strip("|").split(" | "))
                for line in (REPO_DIR / "docs" / doc).read_text().splitlines()
                if line.startswith("| `") and line.count(" | ") == n - 1]
    keys = [(f"`{k.name}`", k.values, k.default, k.help) for k in gpu_arena.config_keys()]
    assert keys == rows("configuration.md", 4)
    assert "backend" in [k.name for k in gpu_arena.config_keys()]
    fields = [(f"`{f.metric}`", f.kind, f"`{f.name}`", f.help) for f in _lib.stat_fields()]
    assert fields == [(m, k, f, h) for m, k, f, _rust, h in rows("metrics.md", 5)]
    assert [f.name for f in _lib.stat_fields()] == [n for n, _ in gpu_arena.GpuArenaStats._fields_]


def test_every_function_declared():
    lib = _lib.lib()
    exported = set(re.findall(r"\b(gpu_arena_\w+)\(", _header_text())) if HEADER.exists() else set()
    for name in set(_lib._SIGNATURES) | exported:
        fn = getattr(lib, name)
        assert fn.argtypes is not None, f"{name} has no argtypes"
        if name in ("gpu_arena_free", "gpu_arena_init", "gpu_arena_reset",
                    "gpu_arena_record_stream", "gpu_arena_string_free"):
            assert fn.restype is None, name
    missing = exported - set(_lib._SIGNATURES) - set(_lib._IPC_SIGNATURES) - set(_lib._NEWER_SIGNATURES)
    assert not missing, f"declared in the header but not in _lib.py: {missing}"


def test_star_import_keeps_the_builtins_and_ipc_has_every_sharing_name():
    names = {}
    exec("from gpu_arena import *", names)
    assert "open" not in names and "close" not in names  # the builtins stay
    assert gpu_arena.open is gpu_arena.ipc.open and gpu_arena.close is gpu_arena.ipc.close
    assert all(hasattr(gpu_arena, n) for n in gpu_arena.__all__)
    sharing = set(gpu_arena.pointers.__all__) | set(gpu_arena.tensors.__all__) | {"ShareHandle"}
    assert sharing <= set(gpu_arena.ipc.__all__)
    assert all(hasattr(gpu_arena.ipc, n) for n in gpu_arena.ipc.__all__)


# ----------------------------------------------------------------------------------------
# Finding the library
# ----------------------------------------------------------------------------------------


def test_lib_path_is_a_search_place():
    path = gpu_arena.lib_path()
    assert os.path.isfile(path)
    env = os.environ.get("GPU_ARENA_LIB")
    if not env:
        assert path in [str(p.resolve()) for p in _lib.candidate_paths() if p.is_file()]


def fake_checkout(monkeypatch, tmp_path, checkout=True):
    """Point the search at a fake repository tree under tmp_path; returns (pkg, repo)."""
    monkeypatch.delenv("GPU_ARENA_LIB", raising=False)
    monkeypatch.delenv("CARGO_TARGET_DIR", raising=False)
    repo = tmp_path / "repo"
    pkg = repo / "python" / "gpu_arena"
    pkg.mkdir(parents=True)
    if checkout:
        (repo / "Cargo.toml").write_text("[workspace]\n")
        (repo / "python" / "pyproject.toml").write_text("")
    monkeypatch.setattr(_lib, "_PKG_DIR", pkg)
    monkeypatch.setattr(_lib, "_REPO_DIR", repo)
    return pkg, repo


def test_not_found_lists_places(monkeypatch, tmp_path):
    pkg, repo = fake_checkout(monkeypatch, tmp_path)
    with pytest.raises(gpu_arena.LibraryNotFoundError) as ei:
        _lib.find_library()
    msg = str(ei.value)
    expected = [
        pkg / _lib.PACKAGED_LIB,
        repo / "target" / "release" / "libgpu_arena.so",
        repo / "target" / "debug" / "libgpu_arena.so",
    ]
    positions = [msg.index(str(p)) for p in expected]
    assert positions == sorted(positions), msg
    assert "GPU_ARENA_LIB" in msg and "cargo build -p gpu-arena-ffi" in msg


def test_outside_a_checkout_target_is_not_searched(monkeypatch, tmp_path):
    pkg, repo = fake_checkout(monkeypatch, tmp_path, checkout=False)
    (repo / "target" / "debug").mkdir(parents=True)
    (repo / "target" / "debug" / "libgpu_arena.so").write_bytes(b"")
    with pytest.raises(gpu_arena.LibraryNotFoundError, match="only when the package runs from a checkout"):
        _lib.find_library()
    (pkg / "_native").mkdir()
    (pkg / _lib.PACKAGED_LIB).write_bytes(b"")
    assert _lib.find_library() == (pkg / _lib.PACKAGED_LIB).resolve()


def test_search_order(monkeypatch, tmp_path):
    pkg, repo = fake_checkout(monkeypatch, tmp_path)
    cargo_target = tmp_path / "ct"
    monkeypatch.setenv("CARGO_TARGET_DIR", str(cargo_target))
    places = [repo / "target" / "debug" / "libgpu_arena.so",
              repo / "target" / "release" / "libgpu_arena.so",
              cargo_target / "debug" / "libgpu_arena.so",
              cargo_target / "release" / "libgpu_arena.so",
              pkg / _lib.PACKAGED_LIB]
    for f in places:  # from the last choice to the first: each new one must win
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
        assert _lib.find_library() == f.resolve()
    monkeypatch.setenv("GPU_ARENA_LIB", str(tmp_path / "elsewhere.so"))
    with pytest.raises(gpu_arena.LibraryNotFoundError, match="GPU_ARENA_LIB"):
        _lib.find_library()  # set but missing: an error, not a fall-through
    (tmp_path / "elsewhere.so").write_bytes(b"")
    assert _lib.find_library() == (tmp_path / "elsewhere.so").resolve()


def test_gpu_arena_lib_env_loads_that_file(tmp_path):
    copy = tmp_path / "libgpu_arena.so"
    shutil.copy(gpu_arena.lib_path(), copy)
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        gpu_arena.init()
        report([gpu_arena.lib_path(), gpu_arena.backend_name()])
        """,
        env={"GPU_ARENA_LIB": str(tmp_path)},  # a directory holding the .so works too
    )
    assert result_of(proc) == [str(copy.resolve()), "sim"]


def test_missing_lib_error_in_fresh_process(tmp_path):
    proc = run_python(
        """
        import gpu_arena   # importing works without the library
        from result_channel import report
        try:
            gpu_arena.stats()
        except gpu_arena.LibraryNotFoundError as e:
            report(str(e))
        """,
        env={"GPU_ARENA_LIB": str(tmp_path / "nope.so")},
    )
    assert "nope.so" in result_of(proc)


# ----------------------------------------------------------------------------------------
# Before init, configuration, init failures (fresh processes)
# ----------------------------------------------------------------------------------------


def test_before_init_pointer_calls_refuse_and_initialize_nothing():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        out = {"initialized": gpu_arena.is_initialized(), "backend": gpu_arena.backend_name()}
        for name, call in [("free", lambda: gpu_arena.free(0x1000, 10)),
                           ("record_stream", lambda: gpu_arena.record_stream(0x1000, 7))]:
            try:
                call()
                out[name] = None
            except gpu_arena.GpuArenaError as e:
                out[name] = [type(e).__name__, e.code, e.message]
        out["still"] = gpu_arena.is_initialized()
        report(out)
        """
    )
    r = result_of(proc)
    assert r.pop("initialized") is False and r.pop("still") is False
    assert r.pop("backend") == ""
    for name, (cls, code, msg) in r.items():
        assert cls == "NotInitializedError" and code == gpu_arena.GPU_ARENA_ERR_NOT_INITIALIZED, (name, msg)
        assert f"gpu_arena_{name}" in msg and "not initialized yet" in msg, (name, msg)


@pytest.mark.parametrize("first", ["stats", "malloc", "device_count", "snapshot", "empty_cache",
                                   "validate"])
def test_lazy_init_straight_after_import(first):
    """No init(): the first call that needs the pool initializes it from the environment."""
    proc = run_python(
        f"""
        import gpu_arena
        from result_channel import report
        first = {first!r}
        if first == "malloc":
            p = gpu_arena.malloc(1000)
            gpu_arena.free(p, 1000)
        else:
            getattr(gpu_arena, first)()
        s = gpu_arena.stats()
        report([gpu_arena.is_initialized(), gpu_arena.backend_name(),
                s["reserved_bytes"], s["requested_bytes"]])
        """,
        env={"GPU_ARENA_BACKEND": "sim"},
        drop=["GPU_ARENA_CONF"],
    )
    initialized, backend, reserved, requested = result_of(proc)
    assert initialized and backend == "sim"
    assert requested == 0
    assert reserved == (2 * MiB if first == "malloc" else 0)  # a small block: a 2 MiB arena


def test_gpu_arena_log_shows_why_auto_passed_over_backends():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        gpu_arena.stats()
        report(gpu_arena.backend_name())
        """,
        env={"GPU_ARENA_BACKEND": "auto", "GPU_ARENA_LOG": "debug"},
        drop=["GPU_ARENA_CONF"],
    )
    backend = result_of(proc)
    assert "gpu-arena initialized" in proc.stderr, proc.stderr
    if backend == "sim":
        assert "backend=auto passed over cuda" in proc.stderr, proc.stderr
        assert "backend=auto passed over hip; using sim" in proc.stderr, proc.stderr


def test_set_log_level():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        gpu_arena.set_log_level("info")
        gpu_arena.stats()
        try:
            gpu_arena.set_log_level("loud")
            bad = None
        except gpu_arena.InvalidArgumentError as e:
            bad = e.message
        report(bad)
        """,
        env={"GPU_ARENA_BACKEND": "sim"},
        drop=["GPU_ARENA_LOG", "GPU_ARENA_CONF"],
    )
    bad = result_of(proc)
    assert "gpu-arena initialized" in proc.stderr, proc.stderr
    assert "loud" in bad and "debug" in bad, bad


def test_configure_then_init_applies():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        gpu_arena.configure("arena_size=8MiB,grow_arenas=0")
        gpu_arena.configure("sim_devices=3")     # calls accumulate
        gpu_arena.init(device_count=3)
        gpu_arena.init()                         # idempotent
        p = gpu_arena.malloc(3 << 20, device=2)  # a large block: an arena_size arena
        s = gpu_arena.stats(2)
        gpu_arena.free(p, 3 << 20, device=2)
        report([gpu_arena.device_count(), s["reserved_bytes"], s["arenas"]])
        """,
        env={"GPU_ARENA_BACKEND": "sim"},
    )
    assert result_of(proc) == [3, 8 * MiB, 1]


def test_conf_env_is_read_at_init():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        gpu_arena.init()
        report([gpu_arena.device_count(), gpu_arena.backend_name()])
        """,
        env={"GPU_ARENA_CONF": "backend=sim,sim_devices=4,arena_size=4MiB"},
        drop=["GPU_ARENA_BACKEND"],
    )
    assert result_of(proc) == [4, "sim"]


def test_bad_configure_strings():
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        out = []
        for conf in ["arena_size=12XB", "nokey=1", "arena_size", "backend=quantum",
                     "arena_size=0", "sim_devices=65"]:
            try:
                gpu_arena.configure(conf)
                out.append(None)
            except gpu_arena.GpuArenaError as e:
                out.append([type(e).__name__, e.code, e.message])
        gpu_arena.configure("arena_size=2MiB")   # a rejected call changed nothing
        gpu_arena.init()
        report([out, gpu_arena.is_initialized()])
        """
    )
    out, ok = result_of(proc)
    assert ok
    for conf, r in zip(["12XB", "nokey", "arena_size", "quantum", "arena_size", "sim_devices"], out):
        assert r is not None, conf
        cls, code, msg = r
        assert cls == "InvalidArgumentError" and code == gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT
        assert msg.startswith("gpu_arena_configure: ") and conf in msg, msg


def test_configure_rejects_non_str():
    with pytest.raises(TypeError):
        gpu_arena.configure(b"arena_size=1MiB")
    with pytest.raises(ValueError):
        gpu_arena.configure("arena_size=1MiB\0")


def failed_init(env: dict) -> dict:
    """In a fresh process with `env`: the error gpu_arena.init() raised (class name, code,
    message), whether gpu-arena then says it is initialized, its backend name, and the
    message of a malloc after the failed init."""
    proc = run_python(
        """
        import gpu_arena
        from result_channel import report
        out = {"error": None}
        try:
            gpu_arena.init()
        except gpu_arena.GpuArenaError as e:
            out["error"] = [type(e).__name__, e.code, e.message]
        out["initialized"] = gpu_arena.is_initialized()
        out["backend"] = gpu_arena.backend_name()
        try:
            gpu_arena.malloc(100)
        except gpu_arena.NotInitializedError as e:
            out["malloc"] = e.message
        report(out)
        """,
        env=env,
    )
    return result_of(proc)


def test_init_failure_unavailable_backend():
    r = failed_init({"GPU_ARENA_BACKEND": "hip"})
    assert r["error"] is not None and not r["initialized"] and r["backend"] == "", r
    cls, code, msg = r["error"]
    assert cls == "UnavailableError" and code == gpu_arena.GPU_ARENA_ERR_UNAVAILABLE, r
    assert "hip" in msg and "failed to initialize" in msg


def test_init_failure_bad_conf_env():
    r = failed_init({"GPU_ARENA_CONF": "arena_size=lots"})
    cls, code, msg = r["error"]
    assert cls == "InvalidArgumentError" and code == gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT
    assert "GPU_ARENA_CONF" in msg and "lots" in msg
    assert "gpu_arena_malloc" in r["malloc"] and "failed to initialize" in r["malloc"]


def test_raw_init_status_code_of_failed_init():
    proc = run_python(
        """
        from result_channel import report
        from gpu_arena import _lib
        lib = _lib.lib()
        lib.gpu_arena_init(-1)
        report([lib.gpu_arena_init_status(), _lib.last_error()])
        """,
        env={"GPU_ARENA_BACKEND": "hip"},
    )
    code, msg = result_of(proc)
    assert code == gpu_arena.GPU_ARENA_ERR_UNAVAILABLE, msg


# ----------------------------------------------------------------------------------------
# In-process: the initialized sim pool
# ----------------------------------------------------------------------------------------


def test_backend_and_devices(arena):
    assert arena.backend_name() == "sim"
    assert arena.device_count() == 2
    assert arena.is_initialized()


def test_configure_after_init(arena):
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.configure("arena_size=1MiB")
    assert_error(ei, gpu_arena.InvalidStateError, gpu_arena.GPU_ARENA_ERR_INVALID_STATE,
                 "gpu_arena_configure", "already initialized by gpu_arena_")


def test_malloc_free_stats(arena):
    before = arena.stats(0)
    ptr = arena.malloc(1000)
    assert ptr and ptr % 512 == 0
    mid = arena.stats(0)
    assert mid["allocations"] == before["allocations"] + 1
    assert mid["allocated_bytes"] == before["allocated_bytes"] + 1024  # 512-byte rounding
    assert mid["requested_bytes"] == before["requested_bytes"] + 1000  # what was asked for
    assert mid["peak_requested_bytes"] >= mid["requested_bytes"]
    assert mid["alloc_count"] == before["alloc_count"] + 1
    assert mid["reserved_bytes"] >= 2 * MiB and mid["arenas"] >= 1  # a 2 MiB small arena
    assert mid["peak_allocated_bytes"] >= mid["allocated_bytes"]
    # The sim backend's memory is host memory: it holds what is written.
    data = bytes(range(256)) * 3
    ctypes.memmove(ptr, data, len(data))
    assert ctypes.string_at(ptr, len(data)) == data
    arena.free(ptr, 1000)
    after = arena.stats(0)
    assert after["allocations"] == before["allocations"]
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["requested_bytes"] == before["requested_bytes"]
    assert after["free_count"] == before["free_count"] + 1
    arena.validate(0)


def test_many_sizes_distinct_and_reused(arena):
    sizes = [1, 511, 512, 513, 4096, MiB, 3 * MiB + 7, 70 * MiB]  # the last exceeds arena_size
    ptrs = [arena.malloc(s) for s in sizes]
    spans = sorted((p, p + s) for p, s in zip(ptrs, sizes))
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), "overlap"
    for p, s in zip(ptrs, sizes):
        arena.free(p, s)
    again = arena.malloc(4096)
    arena.free(again, 4096)
    arena.validate(0)


def test_devices_are_separate(arena):
    p0, p1 = arena.malloc(MiB, device=0), arena.malloc(MiB, device=1)
    s1 = arena.stats(1)
    assert s1["allocations"] >= 1
    with pytest.raises(gpu_arena.GpuArenaError):
        arena.free(p1, MiB, device=0)  # wrong device: refused, nothing changes
    arena.free(p1, MiB, device=1)
    arena.free(p0, MiB, device=0)
    arena.validate(1)


def test_size_zero(arena):
    assert arena.malloc(0) == 0
    arena.free(0, 0)  # freeing NULL does nothing


def test_double_free(arena):
    p = arena.malloc(4096)
    arena.free(p, 4096)
    n = arena.stats()["free_count"]
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.free(p, 4096)
    assert_error(ei, gpu_arena.UnknownPointerError, gpu_arena.GPU_ARENA_ERR_UNKNOWN_POINTER,
                 "gpu_arena_free(", hex(p))
    assert arena.stats()["free_count"] == n
    arena.validate(0)


def test_unknown_pointer(arena):
    bogus = 0xDEAD0000
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.free(bogus, 64)
    assert_error(ei, gpu_arena.UnknownPointerError, gpu_arena.GPU_ARENA_ERR_UNKNOWN_POINTER,
                 "gpu_arena_free(", "0xdead0000")


def test_interior_pointer(arena):
    p = arena.malloc(8192)
    try:
        with pytest.raises(gpu_arena.UnknownPointerError):
            arena.free(p + 512, 4096)
    finally:
        arena.free(p, 8192)


def test_wrong_size_is_refused_and_changes_nothing(arena):
    p = arena.malloc(5000)
    before = arena.stats()
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.free(p, 4999)
    assert_error(ei, gpu_arena.InvalidArgumentError, gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT,
                 "gpu_arena_free(", "size=4999", "allocated with size 5000")
    assert arena.stats() == before
    arena.free(p, 5000)  # still live: the right free works


def test_negative_size_raw_calls(arena):
    lib = _lib.lib()
    assert lib.gpu_arena_malloc(-1, 0, None) is None
    msg = _lib.last_error()
    assert msg.startswith("gpu_arena_malloc") and "negative" in msg and "-1" in msg
    p = arena.malloc(100)
    assert lib.gpu_arena_free_checked(p, -100, 0) == gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT
    assert _lib.last_error().startswith("gpu_arena_free") and "negative" in _lib.last_error()
    lib.gpu_arena_free(p, -100, 0, None)  # the void version: refused too, p stays live
    arena.free(p, 100)
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.malloc(-5)
    assert_error(ei, gpu_arena.InvalidArgumentError, gpu_arena.GPU_ARENA_ERR_INVALID_ARGUMENT,
                 "gpu_arena_malloc", "negative")


def test_invalid_device(arena):
    for call, name in [(lambda: arena.malloc(64, device=2), "gpu_arena_malloc"),
                       (lambda: arena.stats(7), "gpu_arena_stats"),
                       (lambda: arena.validate(-3), "gpu_arena_validate"),
                       (lambda: arena.empty_cache(5), "gpu_arena_empty_cache")]:
        with pytest.raises(gpu_arena.GpuArenaError) as ei:
            call()
        assert_error(ei, gpu_arena.InvalidDeviceError, gpu_arena.GPU_ARENA_ERR_INVALID_DEVICE,
                     name, "out of range")


def test_out_of_memory(arena):
    before = arena.stats(1)["oom_count"]
    with pytest.raises(MemoryError) as ei:
        arena.malloc(4 << 30, device=1)  # sim_capacity=1GiB
    assert_error(ei, gpu_arena.OutOfMemoryError, gpu_arena.GPU_ARENA_ERR_OUT_OF_MEMORY,
                 "gpu_arena_malloc(size=4294967296, device=1)", "out of memory")
    assert arena.stats(1)["oom_count"] == before + 1
    arena.validate(1)


def test_python_side_type_errors(arena):
    with pytest.raises(TypeError):
        arena.malloc(1.5)
    with pytest.raises(TypeError):
        arena.free("0x10", 10)
    with pytest.raises(TypeError):
        arena.stats("0")


def test_record_stream(arena):
    p = arena.malloc(2048)
    arena.record_stream(p, 0x1234)  # sim streams are opaque ids
    arena.free(p, 2048)
    with pytest.raises(gpu_arena.GpuArenaError) as ei:
        arena.record_stream(p, 0x1234)
    assert_error(ei, gpu_arena.UnknownPointerError, gpu_arena.GPU_ARENA_ERR_UNKNOWN_POINTER,
                 "gpu_arena_record_stream")
    arena.empty_cache()
    arena.validate(0)


def test_empty_cache_releases_arenas(arena):
    arena.empty_cache()
    base = arena.stats(0)
    p = arena.malloc(3 * MiB)
    grown = arena.stats(0)
    assert grown["reserved_bytes"] > base["reserved_bytes"] or base["reserved_bytes"] > 0
    arena.empty_cache(0)  # a live allocation keeps its arena
    assert arena.stats(0)["reserved_bytes"] >= 3 * MiB
    arena.free(p, 3 * MiB)
    arena.empty_cache(0)
    s = arena.stats(0)
    assert s["reserved_bytes"] == 0 and s["arenas"] == 0 and s["allocations"] == 0
    assert s["backend_destroys"] > base["backend_destroys"]
    # The void hook PyTorch calls for torch.cuda.empty_cache():
    p = arena.malloc(MiB, device=1)
    arena.free(p, MiB, device=1)
    _lib.lib().gpu_arena_reset()
    assert arena.stats(1)["reserved_bytes"] == 0


def test_snapshot(arena):
    p = arena.malloc(10000)
    try:
        snap = arena.snapshot()
        assert snap["backend"] == "sim"
        assert [d["device"] for d in snap["devices"]] == [0, 1]
        dev0 = snap["devices"][0]
        assert dev0["stats"]["allocations"] == arena.stats(0)["allocations"]
        arena_of_p = [a for a in dev0["arenas"] if a["base"] <= p < a["base"] + a["bytes"]]
        assert len(arena_of_p) == 1 and arena_of_p[0]["live_allocations"] >= 1
        for name in arena.GpuArenaStats().to_dict():
            assert name in dev0["stats"], name
    finally:
        arena.free(p, 10000)


def test_validate_ok(arena):
    arena.validate(0)
    arena.validate(1)


def test_last_error_is_per_thread(arena):
    with pytest.raises(gpu_arena.GpuArenaError):
        arena.free(0xBAD000, 1)
    mine = gpu_arena.last_error()
    seen = []
    t = threading.Thread(target=lambda: seen.append(gpu_arena.last_error()))
    t.start()
    t.join()
    assert seen == [""] and "0xbad000" in mine


def test_threads(arena):
    errors = []

    def work(seed):
        try:
            live = []
            for i in range(300):
                size = 512 * (1 + (seed * 7919 + i * 104729) % 64)
                live.append((arena.malloc(size, device=seed % 2), size))
                if len(live) > 8:
                    p, s = live.pop(0)
                    arena.free(p, s, device=seed % 2)
            for p, s in live:
                arena.free(p, s, device=seed % 2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    arena.validate(0)
    arena.validate(1)


def test_error_objects():
    e = gpu_arena.GpuArenaError(gpu_arena.GPU_ARENA_ERR_OUT_OF_MEMORY, "x: out of memory")
    assert type(e) is gpu_arena.OutOfMemoryError and isinstance(e, MemoryError)
    assert "GPU_ARENA_ERR_OUT_OF_MEMORY" in str(e)
    e = gpu_arena.GpuArenaError(-99, "odd")
    assert type(e) is gpu_arena.GpuArenaError and e.code == -99
    import pickle

    e2 = pickle.loads(pickle.dumps(gpu_arena.UnknownPointerError(-3, "y")))
    assert type(e2) is gpu_arena.UnknownPointerError and e2.message == "y"
    assert issubclass(gpu_arena.InvalidArgumentError, ValueError)


def test_null_returns_raise_by_the_error_code(arena, monkeypatch):
    # gpu_arena_malloc / gpu_arena_snapshot_json return NULL, no code: the exception's class
    # comes from gpu_arena_last_error_code(), never from the message's wording.
    monkeypatch.setattr(_lib, "last_error", lambda: "misleading: out of memory, ipc: x")
    with pytest.raises(gpu_arena.InvalidDeviceError) as ei:
        arena.malloc(64, device=2)
    assert ei.value.code == _lib.lib().gpu_arena_last_error_code() == -5
    with pytest.raises(gpu_arena.InvalidArgumentError):
        arena.malloc(-1)
