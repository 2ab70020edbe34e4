"""Dependencies point one way: the service package (``kvindex``) never imports the worker side
(``workers_shim``); what needs both lives in ``kvtools``. Inside ``kvindex``, modules import only
their own layer and the layers below it (``LAYERS``). And the capture recorder, which the service
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


def imported(source: str, package: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, statement, modules named) for every import in ``source``: ``import``, ``from ... import``
    (relative ones resolved against ``package``; ``from m import a`` names ``m`` and ``m.a``, which may
    be a module), and string literals passed to ``importlib.import_module`` / ``__import__`` /
    ``find_spec``. Imports under ``if TYPE_CHECKING`` and inside functions count too: they are still a
    dependency."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, f"import {alias.name}", [alias.name]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            names = [f"{module}.{a.name}" if module else a.name for a in node.names]
            yield node.lineno, f"from {'.' * node.level}{node.module or ''} import ...", [module, *names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in IMPORT_CALLS and node.args:
                arg = node.args[0]
                literal = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(literal, str):
                    yield node.lineno, f"{name}({literal!r})", [literal]


def imports_of(source: str, package: str, forbidden: str) -> Iterator[tuple[int, str]]:
    """(line, statement) for every import of ``forbidden`` (or a submodule) in ``source``, in every
    form ``imported`` finds."""
    for line, statement, modules in imported(source, package):
        if any(_hits(m, forbidden) for m in modules):
            yield line, statement


def _package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])  # a module's package; an __init__'s package is its folder


def _violations(forbidden: str, paths: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {stmt}"
        for path in paths
        for line, stmt in imports_of(path.read_text(encoding="utf-8"), _package_of(path), forbidden)
    ]


def _cython_sources() -> list[Path]:
    return sorted([*SERVICE.rglob("*.pyx"), *SERVICE.rglob("*.pxd")])


def _cython_imports(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, statement, module) for each import of a Cython source: they are not Python syntax, so a
    line-level check."""
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split()
        if len(words) >= 2 and words[0] in ("import", "cimport", "from"):
            yield i, line.strip(), words[1]


def test_service_package_never_imports_workers_shim() -> None:
    modules = sorted(SERVICE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the package (not an empty glob passing vacuously)
    found = _violations("workers_shim", modules)
    for pyx in _cython_sources():
        for i, stmt, module in _cython_imports(pyx):
            if _hits(module, "workers_shim"):
                found.append(f"{pyx.relative_to(ROOT)}:{i}: {stmt}")
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


# -- layers inside kvindex --------------------------------------------------------------------------

# Bottom to top. A module may import its own layer and the layers below it, never a layer above: the
# data flows up (wire -> sequencer -> index -> scoring -> API), and a stage that needs something from
# above takes it as an argument instead. An entry is a package or a module of kvindex; a module
# belongs to its longest entry (``kvindex.observability`` is split: logs and counters are used by every
# stage, the metric collectors read the scoring and tokenizer state). Modules within one layer may
# import each other.
LAYERS: list[tuple[str, ...]] = [
    # the vocabulary: wire messages, block keys, instance names, the gRPC messages
    ("kvindex.wire", "kvindex.keys", "kvindex._keys_native", "kvindex.instance", "kvindex.v1"),
    # services that know no stage: settings, process lifecycle, logs and counters, tokenizers, TLS and tokens
    (
        "kvindex.config",
        "kvindex.lifecycle",
        "kvindex.observability",
        "kvindex.tokenize",
        "kvindex.security",
    ),
    ("kvindex.sequencer",),
    ("kvindex.index",),
    ("kvindex.fleet",),
    ("kvindex.scoring",),
    # what keeps the index right: the repair state machine and the repairer that runs its requests
    # (they see the consumer through protocols, never import it)
    ("kvindex.repair",),
    # what feeds the index (the consumer drives the repair machine), routing state shared between
    # replicas, and the metric collectors
    (
        "kvindex.ingest",
        "kvindex.routing_sync",
        "kvindex.observability.outcomes",
        "kvindex.observability.fleet",
        "kvindex.observability.hits",
        "kvindex.observability.tokenize",
    ),
    ("kvindex.core",),  # the one assembly of registry, index, sequencer, consumer, ledger and router
    ("kvindex.api",),  # the gRPC servicer and server; kvindex.api.errors is shared with the client
    ("kvindex.client",),
    ("kvindex.capture", "kvindex.route"),  # replay serves the API; the ext_proc picker calls the servicer
    ("kvindex.shards",),  # a shard answers from its consumer's index; a front's servicer asks first
    ("kvindex.service",),
    ("kvindex.cli",),
]

# (importing module, imported module or package, why): upward imports that are meant. None today; an
# entry here must say why the dependency cannot point down.
LAYER_EXCEPTIONS: list[tuple[str, str, str]] = []


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str) -> int | None:
    """The layer of a kvindex module (or of a name inside one), by its longest entry in LAYERS."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for layer, entries in enumerate(LAYERS):
        for entry in entries:
            if _hits(module, entry) and (best is None or len(entry) > best[0]):
                best = (len(entry), layer)
    return None if best is None else best[1]


def _upward_imports(path: Path, statements: Iterator[tuple[int, str, list[str]]]) -> Iterator[str]:
    importer = _module_of(path)
    own = _layer_of(importer)
    assert own is not None, f"{importer} is in no layer: add it to LAYERS in tests/unit/test_layout.py"
    for line, stmt, modules in statements:
        for module in modules:
            layer = _layer_of(module)
            if layer is None or layer <= own:
                continue
            if any(importer == e and _hits(module, target) for e, target, _ in LAYER_EXCEPTIONS):
                continue
            yield f"{path.relative_to(ROOT)}:{line}: {stmt} (layer {own} imports {module}, layer {layer})"
            break


def test_every_module_has_a_layer() -> None:
    modules = sorted([*SERVICE.rglob("*.py"), *_cython_sources()])
    assert len(modules) > 40
    unplaced = [
        str(p.relative_to(ROOT))
        for p in modules
        if p != SERVICE / "__init__.py" and _layer_of(_module_of(p)) is None
    ]
    assert not unplaced, "place these modules in LAYERS (tests/unit/test_layout.py):\n" + "\n".join(unplaced)


def test_imports_point_down_the_layers() -> None:
    found: list[str] = []
    for path in sorted(SERVICE.rglob("*.py")):
        if path == SERVICE / "__init__.py":
            continue  # the top-level package imports nothing
        source = path.read_text(encoding="utf-8")
        found += _upward_imports(path, imported(source, _package_of(path)))
    for pyx in _cython_sources():
        found += _upward_imports(pyx, ((i, stmt, [m]) for i, stmt, m in _cython_imports(pyx)))
    assert not found, (
        "an import from a lower layer to a higher one (LAYERS in tests/unit/test_layout.py): pass what is "
        "needed from above as an argument, or move the code to the layer it belongs to:\n" + "\n".join(found)
    )


def test_layer_check_catches_an_upward_import() -> None:
    # The sequencer (layer 2) importing scoring, in each form, is caught; importing the wire is not.
    source = """
from kvindex.wire.schema import GPU
from kvindex.scoring.ranker import Ranker
from kvindex import scoring
import kvindex.api.servicer
from ..scoring import base
"""
    path = SERVICE / "sequencer" / "cursor.py"
    found = list(_upward_imports(path, imported(source, "kvindex.sequencer")))
    assert [f.split(":")[1] for f in found] == ["3", "4", "5", "6"], found
    # A module belongs to its longest entry: observability's logs sit low, its collectors high.
    assert _layer_of("kvindex.observability.logs") == _layer_of("kvindex.security") == 1
    assert _layer_of("kvindex.observability.outcomes") == _layer_of("kvindex.ingest")
    assert [_layer_of(m) for m in ("kvindex.keys", "kvindex.cli")] == [0, len(LAYERS) - 1]
    assert _layer_of("kvindextools.x") is None and _layer_of("workers_shim") is None
