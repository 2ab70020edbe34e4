"""Size limits a newcomer can read by (issue 35): no function in kvindex/ over 80 lines unless its
docstring says it is a hot loop (kept in one function so its reads stay hoisted: the ranking's
``candidates``, the fleet table's ``refresh``, the servicer's ``score``), and no module of the scoring
or routing core over 600 lines. A function that grows past the limit is split by concern; a module,
by the parts it holds (docs/scoring.md has the module map)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "kvindex"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
SIZED_PACKAGES = ("scoring", "route")  # the core a newcomer changes most (issue 35)
HOT_LOOP = "hot loop"  # in a docstring: a function kept whole on purpose


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> Iterator[tuple[str, int, int]]:
    """(name, first line, lines) of every function or method in ``source`` longer than ``limit``
    lines (from its ``def`` to its last line; nested functions count on their own too), except those
    whose docstring says they are a hot loop."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit and HOT_LOOP not in (ast.get_docstring(node) or "").lower():
                yield node.name, node.lineno, lines


def test_no_function_over_80_lines_outside_hot_loops() -> None:
    modules = sorted(SERVICE.rglob("*.py"))
    assert len(modules) > 40  # the walk found the package
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name} has {n} lines"
        for path in modules
        for name, line, n in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them by concern, or say in the docstring "
        "why a hot loop is kept whole):\n" + "\n".join(found)
    )


def test_scoring_and_routing_modules_stay_under_600_lines() -> None:
    modules = sorted(p for pkg in SIZED_PACKAGES for p in (SERVICE / pkg).rglob("*.py"))
    assert len(modules) > 10
    found = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in modules
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not found, (
        f"modules over {MAX_MODULE_LINES} lines (split them by the parts they hold):\n" + "\n".join(found)
    )


def test_the_function_check_counts_lines_and_honours_hot_loops() -> None:
    def body(n: int, indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    source = (
        f"def long():\n{body(80, 4)}"  # 81 lines
        f"def fits():\n{body(79, 4)}"  # 80
        f'def hot():\n    """A hot loop (every call): kept whole."""\n{body(80, 4)}'
        f"class C:\n    async def method(self):\n{body(80, 8)}"  # 162, with the nested one
        f"        def inner():\n{body(80, 12)}"  # 81
    )
    found = {(name, n) for name, _, n in long_functions(source)}
    assert found == {("long", 81), ("method", 162), ("inner", 81)}
