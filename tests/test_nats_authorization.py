"""Per-worker authorization (issue 13 §2) with the shipped deploy/nats/nats-server.conf on a real
nats-server: the permissions let the whole protocol through (events, heartbeats, replay and snapshot
answers), refuse a worker publishing as another, and the index's own subject/envelope check still
rejects a forged envelope on the worker's own subject (defence in depth)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kvindex.capture.recorder import Capture, CaptureConfig
from kvindex.config import NatsSettings
from kvindex.ingest.nats_source import JetStreamConfig
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.wire import errors
from kvtools.testing.faults import Faults, FaultyPublisher
from tests.conftest import converged, wait_until
from workers_shim.publisher import WorkerLog

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "nats-server.conf"
PASSWORDS = {
    "index": "index-pw-91c2",
    "capture": "capture-pw-55aa",
    "node-1": "node1-pw-0f0f",
    "node-2": "node2-pw-e3e3",
}
MODEL = "llama"


@pytest.fixture
async def secured(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EmbeddedNats]:
    # The shipped config reads its secrets from the environment, as in production.
    for user, password in PASSWORDS.items():
        monkeypatch.setenv(f"KVINDEX_{user.upper().replace('-', '_')}_PASSWORD", password)
    server = EmbeddedNats(config=CONFIG)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def as_user(server: EmbeddedNats, user: str) -> NatsSettings:
    return NatsSettings(servers=(server.url,), user=user, password=PASSWORDS[user])


async def test_workers_cannot_publish_as_each_other(secured: EmbeddedNats) -> None:
    svc = IndexService(
        ServiceConfig(
            nats_url=as_user(secured, "index"),
            grpc_host="127.0.0.1",
            grpc_port=0,
            repair=RepairConfig(reconcile_interval=0),
        )
    )
    await svc.start()
    # node-1 loses its batch 2: the index must ask for a replay, answered through allow_responses.
    faults = Faults(only_seqs={2})
    pubs: list[FaultyPublisher] = []
    rogue: Any = None
    try:
        for worker, f in (("node-1", faults), ("node-2", Faults())):
            pubs.append(
                await FaultyPublisher.connect(
                    as_user(secured, worker),
                    worker=worker,
                    model=MODEL,
                    block_size=4,
                    heartbeat_interval=0.1,
                    faults=f,
                )
            )
        node1, node2 = pubs
        for i in range(3):
            node1.stored(block_keys(list(range(100 * i, 100 * i + 8)), 4, MODEL))
            await node1.flush()
        node2.stored(block_keys(list(range(1000, 1016)), 4, MODEL))
        await converged(svc, node1, node2)
        assert faults.injected["drop"] == 1 and node1.replays_served >= 1
        # A snapshot request (reconciliation) is answered too, in parts if need be.
        svc.consumer.repairs.reconcile(("node-2", 0), "test")
        await wait_until(lambda: node2.snapshots_served >= 1, what="node-2 answering a snapshot")
        await converged(svc, node1, node2)
        restarts, received = svc.counters.restarts, svc.counters.batches_received
        node2_view = set(svc.index.keys_of(("node-2", 0), 0))

        # node-1's credentials, publishing node-2's subjects: refused by NATS.
        violations: list[str] = []

        async def on_error(exc: Exception) -> None:
            violations.append(str(exc))

        rogue = await nats.connect(
            secured.url, user="node-1", password=PASSWORDS["node-1"], error_cb=on_error
        )
        forged = WorkerLog(worker="node-2", model=MODEL, block_size=4)  # a newer epoch: a "restart"
        forged.cleared()
        forged.stored(block_keys(list(range(5000, 5008)), 4, MODEL))
        messages = forged.heartbeat_messages()  # a batch, then a heartbeat
        for subject, data in messages:
            await rogue.publish(subject, data)
        await rogue.flush()
        await wait_until(
            lambda: (
                any('publish to "kvindex.events.node-2"' in v.lower() for v in violations)
                and any('publish to "kvindex.status.node-2"' in v.lower() for v in violations)
            ),
            what="NATS reporting the publish permission violations",
        )
        # Nor may it read the fleet's traffic or take node-2's requests.
        await rogue.subscribe("kvindex.events.>")
        await rogue.subscribe("kvindex.snapshot.node-2")
        await rogue.flush()
        await wait_until(
            lambda: sum("subscription" in v.lower() for v in violations) >= 2,
            what="NATS reporting the subscribe permission violations",
        )

        # Defence in depth: a forged envelope on node-1's own subject passes NATS, not the index.
        mismatches = svc.counters.rejects[errors.SUBJECT_MISMATCH]
        for subject, data in messages:
            await rogue.publish(subject.replace("node-2", "node-1"), data)
        await rogue.flush()
        await wait_until(
            lambda: svc.counters.rejects[errors.SUBJECT_MISMATCH] >= mismatches + 2,
            what="the index rejecting forged envelopes",
        )
        await asyncio.sleep(0.3)  # heartbeats keep flowing: nothing forged may have landed meanwhile
        await converged(svc, node1, node2)
        assert set(svc.index.keys_of(("node-2", 0), 0)) == node2_view
        assert svc.counters.restarts == restarts
        # The refused batch never reached the index: the only batch received since is the one forged
        # on node-1's own subject (and rejected).
        assert svc.counters.batches_received == received + 1
    finally:
        if rogue is not None:
            await rogue.close()
        for p in pubs:
            p.faults.quiet()
            await p.close()
        await svc.stop()


async def test_shipped_permissions_cover_jetstream_and_capture(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The index's permissions suffice for --jetstream (stream, ordered consumer, calibration bucket)
    and the capture user's for `kvindex capture`; the capture user cannot publish."""
    for user, password in PASSWORDS.items():
        monkeypatch.setenv(f"KVINDEX_{user.upper().replace('-', '_')}_PASSWORD", password)
    server = EmbeddedNats(config=CONFIG, jetstream=True)
    await server.start()
    svc = IndexService(
        ServiceConfig(
            nats_url=as_user(server, "index"), grpc_host="127.0.0.1", grpc_port=0, jetstream=JetStreamConfig()
        )
    )
    capture = Capture(as_user(server, "capture"), CaptureConfig(str(tmp_path / "cap.kvlog")))
    pub: Any = None
    try:
        await svc.start()
        await capture.start()
        assert svc.calibration.kv is not None  # the KV bucket was created and read
        pub = await FaultyPublisher.connect(
            as_user(server, "node-1"), worker="node-1", model=MODEL, block_size=4, heartbeat_interval=0.1
        )
        pub.stored(block_keys(list(range(16)), 4, MODEL))
        await converged(svc, pub)
        await wait_until(lambda: capture.recorder.messages >= 2, what="the capture recording")
        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        capture.nc._error_cb = on_error
        await capture.nc.publish("kvindex.events.node-1", b"forged")
        await capture.nc.flush()
        await wait_until(lambda: any("permissions violation" in d for d in denied), what="capture refused")
    finally:
        if pub is not None:
            await pub.close()
        await capture.stop()
        await svc.stop()
        await server.stop()
