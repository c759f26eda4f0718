"""The package's structure: ``gpu_arena`` (``__init__.py``) is the face and only re-exports;
the runtime calls live in ``gpu_arena.runtime``; no module of the package takes a name
from the face (``from . import NAME`` names a module, never a function)."""

import ast
import pkgutil
from pathlib import Path

import gpu_arena
import gpu_arena.runtime

PKG_DIR = Path(gpu_arena.__file__).parent


def test_the_runtime_calls_are_re_exported_unchanged():
    for name in gpu_arena.runtime.__all__:
        assert getattr(gpu_arena, name) is getattr(gpu_arena.runtime, name), name
        assert name in gpu_arena.__all__, name


def test_init_defines_no_function_of_its_own():
    tree = ast.parse((PKG_DIR / "__init__.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined == [], f"__init__.py should only re-export, but defines {defined}"


def test_no_module_imports_a_name_from_the_package_face():
    modules = {m.name for m in pkgutil.iter_modules([str(PKG_DIR)])}
    upward = []
    for path in sorted(PKG_DIR.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                (node.level == 1 and node.module is None) or node.module == "gpu_arena"
            ):
                upward += [f"{path.name}: {a.name}" for a in node.names if a.name not in modules]
    assert not upward, f"names taken from gpu_arena's face instead of their module: {upward}"

