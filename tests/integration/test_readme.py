"""The README's examples, run as written against real parts. The route recipe: its three commands
(kvtools/route_demo.py renders them into the README, tests/unit/test_route_demo.py pins the text) as
processes on free ports — `kvindex serve` with its embedded nats-server, `kvshim sim` serving
simulated engines over HTTP, `kvindex route` — and its curl request, sent twice. The Publisher
snippet: run by a Python process against a real nats-server and index, with the URL swapped for
that server's."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvtools.route_demo import BLOCK_SIZE, PROMPT, Ports, Recipe
from tests.conftest import ROOT, wait_until

README = (ROOT / "README.md").read_text()


async def test_the_readme_route_recipe_answers_a_routed_request(tmp_path: Path) -> None:
    run = Recipe(Ports.free(), str(Path(sys.executable).parent), tmp_path)
    run.start()
    try:
        await run.wait_routable()  # the recipe's `until curl .../v1/models` loop
        first = await run.request()  # its curl
        assert first.status == 200, first.body
        # Sent once the index has heard the engine's KV events (as it has by the time a person
        # types the next curl), the same request goes where its first block is.
        await run.settled(first.headers["x-kvindex-instance"])
        second = await run.request()
    finally:
        codes = await run.stop()
    for answer in (first, second):
        assert answer.status == 200, answer.body
        assert answer.headers["x-kvindex-decision"] == "index"
        assert re.fullmatch(r"sim-[0-3]/0", answer.headers["x-kvindex-instance"])
        assert answer.body["choices"][0]["text"] and answer.body["usage"]["prompt_tokens"] == len(PROMPT)
    # The second goes where the first left the prompt's first block, and the engine reuses it.
    assert second.headers["x-kvindex-instance"] == first.headers["x-kvindex-instance"]
    assert first.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.body["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK_SIZE
    assert codes == [0, 0, 0], [(p.name, p.read_text()[-2000:]) for p in tmp_path.iterdir()]


async def test_the_readme_publisher_snippet_runs_as_written(
    nats_server: EmbeddedNats, service: IndexService
) -> None:
    (snippet,) = [
        b
        for b in re.findall(r"^```python\n(.*?)^```$", README, flags=re.S | re.M)
        if "Publisher(" in b or "Publisher." in b
    ]
    code = snippet.replace("nats://127.0.0.1:4222", nats_server.url)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()
    worker = ("node-3", 0)
    await wait_until(lambda: service.index.block_counts(worker)[0] == 3, what="node-3's 3 blocks indexed")
    state = service.registry.get(worker)
    assert state is not None and state.model == "llama"
    assert service.registry.endpoint("node-3/0") == "10.0.3.7:8000"
    held = block_keys(list(range(1, 65)), 16, "llama")[:3]
    assert set(service.index.keys_of(worker, 0)) == set(held)
