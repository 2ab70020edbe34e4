"""A nats-server cluster on localhost for tests: N nodes with routes between them, JetStream optional."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import nats

from kvindex.service.natsd import EmbeddedNats, free_port


class NatsCluster:
    def __init__(self, size: int = 3, jetstream: bool = False, name: str = "kvindex-test") -> None:
        self.size = size
        self.jetstream = jetstream
        self.name = name
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-cluster-")
        self.nodes: list[EmbeddedNats] = []

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    async def start(self, timeout: float = 20.0, only: int | None = None) -> NatsCluster:
        """Start the nodes and wait until they form a cluster; ``only=N`` starts the first N nodes
        (the rest are configured and can be started later: a cluster still forming)."""
        route_ports = [free_port() for _ in range(self.size)]
        for i, own in enumerate(route_ports):
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in route_ports if p != own)
            conf = Path(self._dir.name) / f"n{i}.conf"
            conf.write_text(
                f"server_name: n{i}\n"
                f"cluster {{ name: {self.name}, listen: 127.0.0.1:{own}, routes: [{routes}] }}\n"
            )
            self.nodes.append(EmbeddedNats(port=free_port(), config=conf, jetstream=self.jetstream))
        running = self.nodes[: self.size if only is None else only]
        await asyncio.gather(*(n.start() for n in running))
        await self._wait_formed(timeout, [n.url for n in running])
        return self

    async def _wait_formed(self, timeout: float, urls: list[str]) -> None:
        """Until a message published on each node reaches subscribers on all others (and, with
        JetStream, the meta leader answers)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conns = [await nats.connect(u) for u in urls]
        try:
            while True:
                if loop.time() > deadline:
                    raise RuntimeError("the NATS cluster did not form")
                ok = True
                for i, nc in enumerate(conns):
                    subject = f"_cluster_probe.{i}"
                    subs = [await other.subscribe(subject, max_msgs=1) for other in conns if other is not nc]
                    for other in conns:
                        await other.flush()
                    await asyncio.sleep(0.05)  # interest propagates over the routes
                    await nc.publish(subject, b"x")
                    await nc.flush()
                    for sub in subs:
                        try:
                            await sub.next_msg(timeout=0.5)
                        except Exception:
                            ok = False
                            with contextlib.suppress(Exception):
                                await sub.unsubscribe()
                if ok and self.jetstream:
                    try:
                        await conns[0].jetstream().account_info()
                    except Exception:
                        ok = False
                if ok:
                    return
                await asyncio.sleep(0.1)
        finally:
            for nc in conns:
                await nc.close()

    async def stop(self) -> None:
        for node in self.nodes:
            await node.stop()
        self._dir.cleanup()

    def node_of(self, url: str) -> EmbeddedNats:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        return next(n for n in self.nodes if n.port == port)
