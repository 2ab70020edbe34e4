"""Dependencies point one way: the service package (``kvindex``) never imports the worker side
(``workers_shim``); what needs both lives in ``kvtools``. And the capture recorder, which the service
builds, does not import the service back."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "kvindex"
IMPORT_CALLS = {"import_module", "__import__", "find_spec"}  # importlib.import_module("..."), ...


def _hits(module: str, forbidden: str) -> bool:
    return module == forbidden or module.startswith(forbidden + ".")


def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1] if node.level <= len(base) else []
    return ".".join([*base, node.module] if node.module else base)


def imports_of(source: str, package: str, forbidden: str) -> Iterator[tuple[int, str]]:
    """(line, statement) for every import of ``forbidden`` (or a submodule) in ``source``: ``import``,
    ``from ... import`` (relative ones resolved against ``package``), and string literals passed to
    ``importlib.import_module`` / ``__import__`` / ``find_spec``. Imports under ``if TYPE_CHECKING``
    and inside functions count too: they are still a dependency."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _hits(alias.name, forbidden):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            names = [f"{module}.{a.name}" if module else a.name for a in node.names]
            if _hits(module, forbidden) or any(_hits(n, forbidden) for n in names):
                yield node.lineno, f"from {'.' * node.level}{node.module or ''} import ..."
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in IMPORT_CALLS and node.args:
                arg = node.args[0]
                literal = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(literal, str) and _hits(literal, forbidden):
                    yield node.lineno, f"{name}({literal!r})"


def _package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])  # a module's package; an __init__'s package is its folder


def _violations(forbidden: str, paths: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {stmt}"
        for path in paths
        for line, stmt in imports_of(path.read_text(encoding="utf-8"), _package_of(path), forbidden)
    ]


def test_service_package_never_imports_workers_shim() -> None:
    modules = sorted(SERVICE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the package (not an empty glob passing vacuously)
    found = _violations("workers_shim", modules)
    # Cython sources are not Python syntax: a line-level check of their imports.
    for pyx in sorted([*SERVICE.rglob("*.pyx"), *SERVICE.rglob("*.pxd")]):
        for i, line in enumerate(pyx.read_text(encoding="utf-8").splitlines(), 1):
            words = line.split()
            is_import = len(words) >= 2 and words[0] in ("import", "cimport", "from")
            if is_import and _hits(words[1], "workers_shim"):
                found.append(f"{pyx.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "kvindex/ must not import workers_shim (move the module to kvtools/):\n" + "\n".join(
        found
    )


def test_import_check_catches_every_form() -> None:
    source = """
import workers_shim
import os, workers_shim.sim as sim
from workers_shim.publisher import Publisher
from workers_shim import sim
import importlib
importlib.import_module("workers_shim.sim.fleet")
__import__("workers_shim")
from .. import workers_shim
import workers_shim_other
from kvindex.keys import block_keys
print("workers_shim is mentioned in a string that is not an import")
"""
    lines = [line for line, _ in imports_of(source, "kvindex.capture", "workers_shim")]
    assert lines == [2, 3, 4, 5, 7, 8]  # ``from ..`` resolves inside kvindex; the rest are not imports
    top = [line for line, _ in imports_of("from .. import workers_shim\n", "kvindex", "workers_shim")]
    assert top == [1]  # from the top-level package, ``..`` reaches the repository's packages


def test_recorder_does_not_import_the_service() -> None:
    recorder = SERVICE / "capture" / "recorder.py"
    found = _violations("kvindex.service", [recorder])
    assert not found, "the recorder must not import the service that builds it:\n" + "\n".join(found)
    # At run time too: importing it alone loads nothing of kvindex.service, nor the worker side.
    code = (
        "import sys, kvindex.capture.recorder; "
        "print(sorted(m for m in sys.modules if m.startswith(('kvindex.service', 'workers_shim'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
