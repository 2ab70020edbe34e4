"""An honest worker's lag while hostile workers make the index repair them and never answer well
(issue 32 item 5; kvindex/repair/README.md "Fairness").

Set-up: a nats-server, ``kvindex serve`` in its own process (defaults, but ``--reconcile-interval``
5 s so that the honest worker's periodic checks come often enough to be measured), and in this
process one honest "control" worker (the real publisher) storing and evicting a block every
``--interval`` and flushing at once. After ``--warm`` s, ``--hostile`` hostile workers
(kvtools/testing/hostile.py: each loses one batch in five, so the index always has a hole to repair,
and answers replays and snapshots with silence, garbage, or a first part never followed by the last)
join for ``--seconds``, then stop publishing (batches and heartbeats) but stay connected, their
responders still answering badly, as a misbehaving worker that hangs would.

With ``--lose-every N`` the control also loses one batch in N on the way and keeps only its last
batch for replays, so that each loss is repaired by a snapshot (the replay answers ``too_old``): its
own repairs then compete with the hostile workers' for the snapshot turns.

Measured every 100 ms over gRPC (``ListInstances`` of the control's model): how far the index's view
of the control is behind what it had published, in batches (published seq - the index's last_seq) and
in seconds (now - when the first batch the index lacks was published; 0 when none is missing), during
the hostile phase; and after the hostile workers fall silent, how long until the control is ``synced``
with everything published before the disconnect applied.

Run: ``.venv/bin/python benchmarks/bench_repair_fairness.py`` (~2.5 min with the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time

import grpc
from bench_score import NatsProcess, code_version, stop_process

from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import FaultyPublisher
from kvtools.testing.hostile import ANSWERS, HostilePublisher, run_hostile

MODEL = "control-model"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Control:
    """The honest worker and when each of its batches was published (monotonic seconds); every
    ``lose_every`` batches (0: never) one is lost on the way, and the worker keeps only its last batch
    for replays, so the index must repair it with a snapshot."""

    def __init__(self, pub: FaultyPublisher, lose_every: int) -> None:
        self.pub = pub
        self.lose_every = lose_every
        self.published_at: dict[int, float] = {}
        self.n = 0

    def note(self) -> None:
        now = time.monotonic()
        for seq in range(len(self.published_at) + 1, self.pub.seq + 1):
            self.published_at[seq] = now

    async def step(self) -> None:
        self.n += 1
        self.pub.stored([self.n])
        if self.n > 256:
            self.pub.removed([self.n - 256])
        if self.lose_every and self.n % self.lose_every == 0:
            self.pub.faults.only_seqs = {self.pub.seq + 1}
        await self.pub.flush()
        self.pub.faults.only_seqs.clear()
        self.note()

    def lag(self, last_seq: int, now: float) -> tuple[int, float]:
        self.note()
        published = self.pub.seq
        if last_seq >= published:
            return 0, 0.0
        return published - last_seq, max(0.0, now - self.published_at[last_seq + 1])


async def run(args: argparse.Namespace) -> None:
    natsd = NatsProcess()
    grpc_port = free_port()
    if args.server_log:
        log = open(args.server_log, "w")  # noqa: SIM115
    else:
        log = tempfile.NamedTemporaryFile(prefix="kvindex-fairness-", suffix=".log", delete=False)  # noqa: SIM115
    argv = [sys.executable, "-m", "kvindex.cli", "serve", "--nats", natsd.url, "--grpc-host", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--metrics-port", "-1", "--log-format", "json"]
    argv += ["--log-level", "info" if args.server_log else "warning"]
    argv += ["--reconcile-interval", str(args.reconcile_interval)]
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    hostile: list[HostilePublisher] = []
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.KvIndexStub(channel)
        await asyncio.wait_for(channel.channel_ready(), 30)
        pub = await FaultyPublisher.connect(
            natsd.url, worker="control", model=MODEL, block_size=16, history=1
        )
        assert isinstance(pub, FaultyPublisher)
        control = Control(pub, args.lose_every)
        phase = "warm"
        samples: dict[str, list[tuple[int, float]]] = {"warm": [], "hostile": [], "after": []}
        stopped_at: float | None = None
        stopped_seq = 0
        resync: float | None = None

        async def publish() -> None:
            while True:
                await control.step()
                await asyncio.sleep(args.interval)

        async def sample() -> None:
            nonlocal resync
            while True:
                await asyncio.sleep(0.1)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=2)
                    now = time.monotonic()
                    for info in reply.instances:
                        samples[phase].append(control.lag(info.last_seq, now))
                        if (
                            stopped_at is not None
                            and resync is None
                            and info.sync == "synced"
                            and info.last_seq >= stopped_seq
                        ):
                            resync = now - stopped_at

        tasks = [asyncio.create_task(publish()), asyncio.create_task(sample())]
        await asyncio.sleep(args.warm)
        phase = "hostile"
        for i in range(args.hostile):
            hostile.append(
                await HostilePublisher.connect(
                    natsd.url,
                    worker=f"hostile-{i}",
                    model="hostile-model",
                    block_size=16,
                    answer=ANSWERS[i % len(ANSWERS)],
                )
            )
        stop = asyncio.Event()
        noise = asyncio.create_task(run_hostile(hostile, stop))
        await asyncio.sleep(args.seconds)
        stop.set()
        await noise
        for pub in hostile:
            await pub.go_quiet()  # still connected: requests to them still go unanswered
        phase = "after"
        stopped_at = time.monotonic()
        control.note()
        stopped_seq = control.pub.seq
        deadline = stopped_at + args.after
        while resync is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        requests = sum(p.requests for p in hostile)
        for t in tasks:
            t.cancel()
        await control.pub.close()
        await channel.close()
    finally:
        for pub in hostile:
            await pub.close()
        stop_process(server, 10)
        natsd.stop()
        log.close()
        if not args.server_log:
            with contextlib.suppress(OSError):
                os.unlink(log.name)

    print(f"code: {code_version()}")
    print(
        f"{args.hostile} hostile workers for {args.seconds:.0f} s ({requests} requests answered badly), "
        f"control publishing every {args.interval * 1000:.0f} ms ({control.pub.seq} batches), "
        f"reconcile interval {args.reconcile_interval:g} s"
    )
    print("| phase | samples | lag p50 | lag p99 | lag max |")
    print("|---|---|---|---|---|")
    for name in ("warm", "hostile", "after"):
        got = samples[name]
        batches = [float(b) for b, _ in got]
        secs = [s for _, s in got]
        print(
            f"| {name} | {len(got)} | {pct(batches, 0.5):.0f} batches / {pct(secs, 0.5):.2f} s "
            f"| {pct(batches, 0.99):.0f} / {pct(secs, 0.99):.2f} s "
            f"| {max(batches, default=0):.0f} / {max(secs, default=0):.2f} s |"
        )
    if args.lose_every:
        print(f"control loses one batch in {args.lose_every} (each repaired by a snapshot)")
    print(
        "resync after the hostile workers fell silent: "
        + (f"{resync:.2f} s" if resync is not None else f"not within {args.after:.0f} s")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hostile", type=int, default=40, help="hostile workers")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long they stay")
    parser.add_argument("--warm", type=float, default=10.0, help="control alone before (s)")
    parser.add_argument("--after", type=float, default=90.0, help="most to wait for the resync (s)")
    parser.add_argument("--interval", type=float, default=0.05, help="control batch every (s)")
    parser.add_argument("--reconcile-interval", type=float, default=5.0)
    parser.add_argument("--server-log", help="keep the service's log (info level) in this file")
    parser.add_argument(
        "--lose-every", type=int, default=0, help="the control loses one batch in this many (0: none)"
    )
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
