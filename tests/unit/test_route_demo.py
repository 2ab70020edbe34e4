"""The README's examples cannot drift from what is tested: the route recipe in the README is exactly
the commands `make run-route` runs and tests/integration/test_readme.py runs (kvtools/route_demo.py
renders them), its curl body is the request they send, and the Publisher snippet is a whole
program (run against a real index by tests/integration/test_readme.py)."""

from __future__ import annotations

import ast
import json
import re
import shlex

from kvtools.route_demo import REQUEST, Ports, readme_block, recipe, request_json
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def sh_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_route_recipe_is_the_one_run_route_runs() -> None:
    (block,) = [b for b in sh_blocks(README, "sh") if "kvshim sim" in b and "kvindex route" in b]
    assert block == readme_block() + "\n"
    # Read back as a shell would: the three background commands are recipe()'s, word for word.
    joined = block.replace("\\\n", " ")
    started = [
        shlex.split(line.split(">/tmp/")[0])
        for line in joined.splitlines()
        if line.rstrip().endswith("&") and not line.startswith("#")
    ]
    assert started == recipe(Ports())
    (body,) = re.findall(r"-d '(.*)'", joined)
    assert body == request_json() and json.loads(body) == REQUEST


def test_the_readme_publisher_snippet_is_a_whole_program() -> None:
    (snippet,) = [b for b in sh_blocks(README, "python") if "workers_shim.publisher import Publisher" in b]
    tree = ast.parse(snippet)
    assert snippet.count("nats://127.0.0.1:4222") == 1  # the URL the recipe's index serves
    assert isinstance(tree.body[-1], ast.Expr) and ast.unparse(tree.body[-1]) == "asyncio.run(main())"
