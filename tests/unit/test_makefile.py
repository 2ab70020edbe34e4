"""Every public Makefile target can run: each one's prerequisites exist or have a rule, a dry run
(``make -n -B``) of it succeeds, and every repository file or module its recipes name exists. A moved
file must not surface only after ``make e2e-vllm`` has spent minutes installing vLLM.

Public targets: the ``.PHONY`` ones, every target that is a word rather than a path, and every
``make X`` the Markdown files show. ``make -n`` prints recipes without running them, except lines
prefixed with ``+`` (refused below) and ``$(MAKE)`` lines, whose sub-make inherits ``-n`` from
MAKEFLAGS and so only prints as well."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"

# A recipe word with one of these endings names a file that must be in the repository. What recipes
# make (venvs, models, .kvlog logs) has none of them, or is a rule's target.
SOURCE_SUFFIXES = (".py", ".pyx", ".proto", ".md", ".json", ".jsonl", ".toml", ".yaml", ".yml", ".txt", ".sh")
_DB_GOAL = "_makefile_test_database"  # an empty goal: printing the database runs no recipe


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    assert make, "make is not installed (the Makefile is how this repository is built and tested)"
    # The parent make's flags (make test: jobserver descriptors, its own -n or -k) are not ours.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    env["LC_ALL"] = "C"
    # ARGS is the pass-through every target documents; empty, an undefined variable is a typo.
    return subprocess.run(
        [make, "-C", str(ROOT), "--warn-undefined-variables", "ARGS=", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@functools.cache
def rules() -> dict[str, tuple[str, ...]]:
    """Every target of the Makefile (variables expanded) -> its prerequisites, from make's database."""
    done = _make("-p", "-q", "-r", "-R", f"--eval={_DB_GOAL}:", _DB_GOAL)
    assert done.stdout, done.stderr
    out: dict[str, tuple[str, ...]] = {}
    section = False
    previous = ""
    for line in done.stdout.splitlines():
        if line.startswith("# Files"):
            section = True
        elif line.startswith("# Finished Make data base"):
            section = False
        elif section and previous != "# Not a target:":
            m = re.match(r"([^#\s%][^=]*?):(?:\s+(.*))?$", line)
            if m and m.group(1) != _DB_GOAL:
                out[m.group(1)] = tuple((m.group(2) or "").split("|")[0].split())
        previous = line
    return out


def _top_level() -> set[str]:
    """The repository's top-level files and folders (hidden and build ones are not its files)."""
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("build", "dist")}


def documented_targets() -> dict[str, list[str]]:
    """``make X`` in the repository's Markdown, as inline code or a line of a code block:
    target -> where it is named."""
    found: dict[str, list[str]] = {}
    # Only under the repository's own entries: the venvs (hidden) hold thousands of other files.
    entries = sorted(ROOT / name for name in _top_level())
    pages = [
        p
        for e in entries
        for p in ([e] if e.suffix == ".md" else sorted(e.rglob("*.md")) if e.is_dir() else [])
    ]
    for path in pages:
        rel = path.relative_to(ROOT)
        fenced = False
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            names = re.findall(r"`make ([a-z][a-z0-9_-]*)", line)
            if fenced:
                names += re.findall(r"^\s*(?:\$ )?make ([a-z][a-z0-9_-]*)", line)
            for name in names:
                found.setdefault(name, []).append(f"{rel}:{n}")
    return found


def public_targets() -> list[str]:
    db = rules()
    phony = set(db.get(".PHONY", ()))
    words = {t for t in db if re.fullmatch(r"[a-z][a-z0-9_-]*", t)}
    return sorted(phony | words | set(documented_targets()))


def dry_run(target: str) -> subprocess.CompletedProcess[str]:
    """``make -n -B TARGET``: every recipe on the way printed, whether or not the stamps and venvs
    exist (nothing runs), a missing prerequisite an error."""
    return _make("-n", "-B", target)


def missing_prerequisites(target: str) -> list[str]:
    """Prerequisites on the way to ``target`` that are neither a rule's target nor a file."""
    db = rules()
    missing: list[str] = []
    seen: set[str] = set()
    todo = [target]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in db:
            todo.extend(db[name])
        elif not (ROOT / name).exists():
            missing.append(name)
    return sorted(missing)


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes in a shell construct: plain words are enough here
        return line.split()


def named_files(recipe: str) -> set[str]:
    """The repository files printed recipes name: paths under a top-level entry of the repository
    with a source suffix or none (a folder), and the files of ``-m`` modules of its packages; not
    what a rule makes, nor the folder a rule makes its target in."""
    top = _top_level()
    made = set(rules())
    made_in = {str(Path(t).parent) for t in made}
    out: set[str] = set()
    for line in recipe.splitlines():
        words = _words(line)
        for i, word in enumerate(words):
            value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
            if i and words[i - 1] == "-m":
                module = value.replace(".", "/")
                if value.split(".")[0] in top and (ROOT / value.split(".")[0]).is_dir():
                    out.add(f"{module}/__init__.py" if (ROOT / module).is_dir() else f"{module}.py")
            elif "/" in value and value.split("/")[0] in top and value not in made:
                if value.endswith(SOURCE_SUFFIXES):
                    out.add(value)
                elif "." not in value.rsplit("/", 1)[1] and value not in made_in:
                    out.add(value)  # a folder (tests/unit), unless one a rule makes
    return out


def test_no_recipe_line_runs_under_a_dry_run() -> None:
    # `+` makes a line run even under -n: the dry runs below would install or delete for real.
    plus = [
        f"Makefile:{n}: {line.strip()}"
        for n, line in enumerate(MAKEFILE.read_text().splitlines(), 1)
        if re.match(r"\t[@-]*\+", line)
    ]
    assert not plus, "recipe lines that run under make -n:\n" + "\n".join(plus)


def test_documented_targets_exist() -> None:
    db = rules()
    missing = {name: where for name, where in documented_targets().items() if name not in db}
    assert not missing, f"`make X` in the docs with no such target in the Makefile: {missing}"


def test_the_check_sees_targets_prerequisites_and_files() -> None:
    # The checks below are only as good as what they walk: the targets the README promises, the
    # prerequisites of a file rule, the files a recipe names (and not the ones it makes).
    assert {"run", "test", "test-fast", "serve", "e2e-vllm", "e2e-feedback", "sample-log"} <= set(
        public_targets()
    )
    assert "e2e/make_model.py" in rules()["e2e/routing-llama/kvindex-e2e.json"]
    assert named_files(dry_run("e2e-routing").stdout) >= {"e2e/run_routing.py", "e2e/make_model.py"}
    recipe = "x/bin/python -m kvtools.demo --trace=kvtools/data/nosuch.jsonl docs/a.kvlog e2e/tiny-llama"
    assert named_files(recipe + " tests/nosuch") == {
        "kvtools/demo.py",
        "kvtools/data/nosuch.jsonl",
        "tests/nosuch",
    }
    assert named_files(".venv/bin/python -m pytest -q .fuzz/x.json -m kvtools.testing") == {
        "kvtools/testing/__init__.py"
    }


@pytest.mark.parametrize("target", public_targets())
def test_target_dry_runs_and_names_only_existing_files(target: str) -> None:
    needed = missing_prerequisites(target)
    assert not needed, f"make {target} needs {needed}: no such file, and no rule makes it"
    done = dry_run(target)
    assert done.returncode == 0, f"make -n {target} fails:\n{done.stderr}"
    assert "warning: undefined variable" not in done.stderr, done.stderr
    assert done.stdout.strip(), f"make -n {target} runs nothing"
    missing = sorted(p for p in named_files(done.stdout) if not (ROOT / p).exists())
    assert not missing, f"make {target} names files that are not in the repository: {missing}"
