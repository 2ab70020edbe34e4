"""make e2e-observability: the dashboards and alerting rules of deploy/observability checked against a
real Prometheus scraping a loaded fleet (docs/observability.md has the method and the results).

Runs, all on 127.0.0.1: a nats-server; ``kvindex serve`` on it with the Envoy ext_proc picker;
``kvshim sim`` (simulated engines over HTTP); ``kvindex route`` in front of them; and Prometheus
(Debian's package: ``prometheus``, ``promtool``) scraping the index and the proxy every second with
the generated rules, their windows and holds shortened (``alerts.render_rules(window, hold)``: same
expressions). Load goes through the proxy and, as Envoy would send it, through the picker. Then:

1. ``promtool check rules`` on both committed rule files' groups, ``promtool test rules`` on the
   committed unit tests;
2. live, each fault made and fixed, the matching alerts fire and clear (``/api/v1/alerts``):
   garbage on the events subject (KvIndexRejectsSpike); a worker whose lost batch cannot be replayed
   or snapshotted (KvIndexInstanceDegraded, cleared by answering again); an engine down while its
   sidecar heartbeats, and the index paused for 2 s (no alert: upstream errors, retries and
   fallbacks for the dashboards); nats-server stopped (KvIndexNatsDisconnected, KvIndexNotReady;
   restarted); long prompts far over capacity (KvIndexShedding, KvIndexGoodputLow; load back to
   normal). Every alert that fired at all is listed (the ALERTS series);
3. every query of every dashboard, evaluated over the run (``/api/v1/query_range``, ``$__rate_interval``
   as 15 s), returns series.

Writes e2e/out-observability/ (logs, prometheus.yml, the live rules, results.json). Exit 0 when all of
it holds, 1 otherwise, 2 when prometheus/promtool are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_vllm import Proc, free_port, wait_log_event  # beside this script

from kvindex.keys import block_keys
from kvindex.route.ext_proc import DESTINATION, LB_NAMESPACE, SERVED
from kvindex.service.natsd import nats_server_binary
from kvindex.shards.layout import nats_mappings
from kvindex.wire.subjects import Subjects
from kvtools.observability import alerts
from kvtools.observability.dashboards import DASHBOARDS, RATE
from kvtools.testing.faults import Faults, FaultyPublisher

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "sim-model"
BLOCK = 16
OBJECTIVE_MS = 1500  # the TTFT objective of every request (proxy and picker)
SHARDS_PREFIX = "kvshards"  # the shard deployment beside the index under test (no workers)
RATE_INTERVAL = "15s"  # $__rate_interval with a 1 s scrape interval
LIVE_WINDOW, LIVE_HOLD = "20s", "5s"  # the live rules' range windows and holds
# Overload prompts: about 1.8 s of prefill on the simulated 70B engines, over the 1.5 s objective even
# on an idle engine (admission then serves some best-effort on idle ones and sheds the rest).
LONG_PROMPT = 12_000
MEDIUM_PROMPT = 3_000  # about 0.4 s of prefill


# -- the parts ---------------------------------------------------------------------------------------


@dataclass
class Ports:
    nats: int = field(default_factory=free_port)
    grpc: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    ext_proc: int = field(default_factory=free_port)
    route: int = field(default_factory=free_port)
    prometheus: int = field(default_factory=free_port)
    front: int = field(default_factory=free_port)  # a shard front's /metrics (docs/shards.md)


def prometheus_config(ports: Ports, rules: Path) -> str:
    return yaml.safe_dump(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "kvindex", "static_configs": [{"targets": [f"127.0.0.1:{ports.metrics}"]}]},
                {"job_name": "kvindex-route", "static_configs": [{"targets": [f"127.0.0.1:{ports.route}"]}]},
                {"job_name": "kvindex-front", "static_configs": [{"targets": [f"127.0.0.1:{ports.front}"]}]},
            ],
        },
        sort_keys=False,
    )


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.base}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alerts(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/alerts")["alerts"]

    def value(self, expr: str) -> float | None:
        result = self.get("/api/v1/query", query=expr)["result"]
        return float(result[0]["value"][1]) if result else None


def prompt(rng: random.Random, prefix: int, prefix_len: int, tail: int) -> list[int]:
    """A shared prefix (one of a few system prompts) and a unique tail."""
    shared = random.Random(prefix).sample(range(1, 50_000), prefix_len)
    return shared + [rng.randrange(50_000, 100_000) for _ in range(tail)]


# -- the driver ---------------------------------------------------------------------------------------


@dataclass
class Event:
    alert: str
    fault: str
    fired_s: float | None = None  # seconds from making the fault to the alert firing
    cleared_s: float | None = None  # seconds from the fix to the alert gone
    labels: dict[str, str] = field(default_factory=dict)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.ports = Ports()
        self.procs: dict[str, Proc] = {}
        self.prom = Prometheus(self.ports.prometheus)
        self.rng = random.Random(args.seed)
        self.load_rate = args.rate  # proxy requests/s, changed by the overload phase
        self.long_prompts = False
        self.phase = "warm-up"
        # phase -> front (proxy, picker) -> HTTP status -> requests (0: no answer)
        self.statuses: dict[str, dict[str, dict[int, int]]] = {}
        self.events: list[Event] = []
        self.notes: list[str] = []
        self.started = time.time()
        self.tasks: list[asyncio.Task[None]] = []
        self.timeline: list[tuple[str, float]] = []  # (what, seconds from the start)

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.started:6.1f}s] {msg}", flush=True)

    # -- processes -----------------------------------------------------------------------------------

    def start_nats(self) -> None:
        # Partitions the prefix of the shards (their own, without workers: the dashboards' shard
        # panels need a front and its shards, not load).
        conf = self.out / "nats.conf"
        conf.write_text(nats_mappings(Subjects(SHARDS_PREFIX), 2))
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.ports.nats), "-c", str(conf)]
        self.procs["nats"] = Proc("nats-server", argv, self.out / "nats.log")
        deadline = time.monotonic() + 10
        while "Server is ready" not in (self.out / "nats.log").read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start:\n{self.procs['nats'].tail()}")
            time.sleep(0.1)

    def start(self) -> None:
        p, nats = self.ports, f"nats://127.0.0.1:{self.ports.nats}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.start_nats()
        slo = f"{MODEL}={OBJECTIVE_MS}"
        serve = [
            str(BIN / "kvindex"), "serve", "--nats", nats, "--grpc-host", "127.0.0.1",
            "--grpc-port", str(p.grpc),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(p.metrics), "--ext-proc-host", "127.0.0.1",
            "--ext-proc-port", str(p.ext_proc), "--ttft-slo-ms", slo, "--replay-timeout", "1",
            "--snapshot-timeout", "2", "--log-format", "json",
        ]  # fmt: skip
        self.procs["serve"] = Proc("kvindex serve", serve, self.out / "kvindex.log")
        wait_log_event(self.out / "kvindex.log", "kvindex_serving", self.procs["serve"], 60)
        shard = ["--metrics-port", "-1", "--shard"]  # (the shards' own metrics are an index's)
        for name, role in (("shard-0", [*shard, "0/2"]), ("shard-1", [*shard, "1/2"]), ("front", None)):
            argv = [
                str(BIN / "kvindex"), "serve", "--nats", nats, "--subject-prefix", SHARDS_PREFIX,
                "--grpc-host", "127.0.0.1", "--grpc-port", str(free_port()), "--no-routing-sync",
                "--log-format", "json", *(role or ["--shards", "2", "--metrics-host", "127.0.0.1",
                                                   "--metrics-port", str(p.front)]),
            ]  # fmt: skip
            self.procs[name] = Proc(f"kvindex serve ({name})", argv, self.out / f"kvindex-{name}.log")
        wait_log_event(self.out / "kvindex-front.log", "readiness_changed", self.procs["front"], 60)
        sim = [
            str(BIN / "kvshim"), "sim", "--nats", nats, "--workers", str(self.args.workers), "--model", MODEL,
            "--http-host", "127.0.0.1", "--http-port", "0", "--profile", "llama3-70b-8xa800",
            "--block-size", str(BLOCK), "--seed", str(self.args.seed),
        ]  # fmt: skip
        self.procs["sim"] = Proc("kvshim sim", sim, self.out / "kvshim-sim.log")
        route = [
            str(BIN / "kvindex"), "route", "--index", f"127.0.0.1:{p.grpc}", "--host", "127.0.0.1",
            "--port", str(p.route), "--ttft-slo-ms", slo, "--log-format", "json",
        ]  # fmt: skip
        self.procs["route"] = Proc("kvindex route", route, self.out / "kvindex-route.log")
        wait_log_event(self.out / "kvindex-route.log", "route_started", self.procs["route"], 60)
        rules = self.out / "kvindex-rules-live.yaml"
        rules.write_text(alerts.render_rules(window=LIVE_WINDOW, hold=LIVE_HOLD))
        config = self.out / "prometheus.yml"
        config.write_text(prometheus_config(p, rules))
        self.promtool("check", "config", str(config))
        shutil.rmtree(self.out / "prometheus-data", ignore_errors=True)
        prom = [
            self.args.prometheus, f"--config.file={config}",
            f"--storage.tsdb.path={self.out / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{p.prometheus}", "--log.level=warn",
        ]  # fmt: skip
        self.procs["prometheus"] = Proc("prometheus", prom, self.out / "prometheus.log")
        deadline = time.monotonic() + 30
        while not self.prom.ready():
            if time.monotonic() > deadline or not self.procs["prometheus"].alive():
                raise RuntimeError(f"prometheus did not start:\n{self.procs['prometheus'].tail()}")
            time.sleep(0.2)

    def promtool(self, *args: str, cwd: Path | None = None) -> str:
        done = subprocess.run(
            [self.args.promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=120
        )
        out = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            raise RuntimeError(f"promtool {' '.join(args)} failed:\n{out}")
        return out

    def stop(self) -> None:
        for name in ("prometheus", "route", "sim", "front", "shard-0", "shard-1", "serve", "nats"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(timeout=15)

    # -- load ------------------------------------------------------------------------------------------

    def count(self, front: str, code: int) -> None:
        by_code = self.statuses.setdefault(self.phase, {}).setdefault(front, {})
        by_code[code] = by_code.get(code, 0) + 1

    async def proxy_load(self, http: aiohttp.ClientSession) -> None:
        """Poisson arrivals at ``self.load_rate`` through the proxy, each request in its own task."""
        url = f"http://127.0.0.1:{self.ports.route}/v1/completions"
        pending: set[asyncio.Task[None]] = set()

        async def one(tokens: list[int]) -> None:
            # Streamed: the proxy measures the TTFT (first chunk) and reports it with the release.
            body = {"model": MODEL, "prompt": tokens, "max_tokens": 8, "stream": True}
            try:
                async with http.post(url, json=body) as r:
                    await r.read()
                    code = r.status
            except aiohttp.ClientError:
                code = 0
            self.count("proxy", code)

        while True:
            await asyncio.sleep(self.rng.expovariate(self.load_rate))
            if self.long_prompts:  # far over the fleet's capacity
                # Half longer to prefill than their objective even on an idle engine (served best effort
                # or shed), half that an engine could serve in time once free (held, then served or shed).
                length = LONG_PROMPT if self.rng.random() < 0.5 else MEDIUM_PROMPT
                tokens = prompt(self.rng, 1000 + self.rng.randrange(10**6), length, 16)
            else:
                tokens = prompt(self.rng, self.rng.randrange(8), 16 * BLOCK, self.rng.randrange(16, 160))
            task = asyncio.create_task(one(tokens))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def picker_load(self, http: aiohttp.ClientSession) -> None:
        """Requests as Envoy sends them through the picker (buffered bodies), forwarded to the engine
        it picks, the engine's answer passed back through the picker."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.ports.ext_proc}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            while True:
                await asyncio.sleep(self.rng.expovariate(self.args.picker_rate))
                tokens = prompt(self.rng, self.rng.randrange(8), 16 * BLOCK, self.rng.randrange(16, 160))
                try:
                    code = await self.envoy_request(stub, http, tokens)
                except (grpc.aio.AioRpcError, aiohttp.ClientError, TimeoutError) as exc:
                    code = 0
                    self.notes.append(f"picker request failed: {type(exc).__name__}")
                self.count("picker", code)

    async def envoy_request(self, stub: Any, http: aiohttp.ClientSession, tokens: list[int]) -> int:
        body = json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 8}).encode()
        mode = mode_pb2.ProcessingMode.BUFFERED
        headers = core_pb2.HeaderMap(
            headers=[
                core_pb2.HeaderValue(key=k, raw_value=v.encode())
                for k, v in (
                    (":method", "POST"),
                    (":path", "/v1/completions"),
                    ("content-type", "application/json"),
                    ("x-request-id", f"picker-{self.rng.getrandbits(64):x}"),
                )
            ]
        )
        call = stub.Process()
        try:
            await call.write(
                ep.ProcessingRequest(
                    request_headers=ep.HttpHeaders(headers=headers),
                    protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
                )
            )
            await asyncio.wait_for(call.read(), 30)  # the headers' answer
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
            pick = await asyncio.wait_for(call.read(), 30)
            if pick.HasField("immediate_response"):
                return int(pick.immediate_response.status.code)
            mutation = pick.request_body.response.header_mutation.set_headers
            picked = next(h.header.raw_value.decode() for h in mutation if h.header.key == DESTINATION)
            # As Envoy does: the first endpoint, the next ones on a connection failure.
            for endpoint in picked.split(","):
                try:
                    async with http.post(f"http://{endpoint}/v1/completions", data=body) as r:
                        answer, status = await r.read(), r.status
                    break
                except aiohttp.ClientConnectionError:
                    self.notes.append("picker: an endpoint refused the connection, the next one served")
            else:
                return 0
            meta = core_pb2.Metadata()
            meta.filter_metadata[LB_NAMESPACE].update({SERVED: endpoint})
            response_headers = core_pb2.HeaderMap(
                headers=[
                    core_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                    core_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                ]
            )
            await call.write(
                ep.ProcessingRequest(
                    response_headers=ep.HttpHeaders(headers=response_headers), metadata_context=meta
                )
            )
            await asyncio.wait_for(call.read(), 30)
            await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=answer, end_of_stream=True)))
            await asyncio.wait_for(call.read(), 30)
            await call.done_writing()
            return status
        finally:
            call.cancel()

    # -- faults and alerts -----------------------------------------------------------------------------

    def firing(self, name: str, **labels: str) -> dict[str, Any] | None:
        for a in self.prom.alerts():
            mine = all(a["labels"].get(k) == v for k, v in labels.items())
            if a["labels"].get("alertname") == name and a["state"] == "firing" and mine:
                return a
        return None

    async def until(self, what: str, predicate: Any, timeout: float) -> float | None:
        """Seconds until ``predicate()`` holds (polled every 0.5 s), None after ``timeout``."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if await asyncio.to_thread(predicate):
                return time.monotonic() - started
            await asyncio.sleep(0.5)
        self.log(f"timed out waiting for {what}")
        return None

    async def fire_and_clear(
        self, fault: str, names: list[str], make: Any, fix: Any, labels: dict[str, str] | None = None
    ) -> None:
        labels = labels or {}
        events = [Event(n, fault, labels=labels) for n in names]
        self.events += events
        self.phase = fault
        self.log(f"{fault}: made")
        self.timeline.append((f"{fault} made", round(time.time() - self.started, 1)))
        await make()
        made = time.monotonic()
        for e in events:
            seconds = await self.until(f"{e.alert} firing", lambda e=e: self.firing(e.alert, **labels), 120)
            e.fired_s = None if seconds is None else time.monotonic() - made
            self.log(
                f"  {e.alert}: "
                + (f"firing after {e.fired_s:.1f} s" if e.fired_s is not None else "NOT firing")
            )
        await fix()
        fixed = time.monotonic()
        self.timeline.append((f"fixed {fixed - made:.0f} s later", round(time.time() - self.started, 1)))
        self.log(f"{fault}: fixed")
        for e in events:
            seconds = await self.until(
                f"{e.alert} cleared", lambda e=e: not self.firing(e.alert, **labels), 180
            )
            e.cleared_s = None if seconds is None else time.monotonic() - fixed
            done = f"cleared after {e.cleared_s:.1f} s" if e.cleared_s is not None else "NOT cleared"
            self.log(f"  {e.alert}: {done}")

    async def rejects(self) -> None:
        import nats

        nc = await nats.connect(f"nats://127.0.0.1:{self.ports.nats}")
        garbage = asyncio.Event()

        async def send() -> None:
            while not garbage.is_set():
                await nc.publish("kvindex.events.garbage-0", b"\x93not msgpack of a batch")
                await asyncio.sleep(0.2)  # 5 a second

        task: asyncio.Task[None] | None = None

        async def make() -> None:
            nonlocal task
            task = asyncio.create_task(send())

        async def fix() -> None:
            garbage.set()
            if task is not None:
                await task

        await self.fire_and_clear(
            "garbage on the events subject (5 messages/s)", ["KvIndexRejectsSpike"], make, fix
        )
        await nc.close()

    async def degraded(self) -> None:
        """A worker loses a batch and answers neither the replay nor the snapshot the index asks for:
        the repair fails and the instance is degraded until it answers again."""

        class Mute(FaultyPublisher):
            mute = False

            async def _on_replay(self, msg: Any) -> None:
                if not self.mute:
                    await super()._on_replay(msg)

            async def _on_snapshot(self, msg: Any) -> None:
                if not self.mute:
                    await super()._on_snapshot(msg)

        faults = Faults()
        pub = await Mute.connect(
            f"nats://127.0.0.1:{self.ports.nats}",
            worker="faulty-0",
            model="faulty-model",  # no requests go its way: it only has to be known and wrong
            block_size=BLOCK,
            capacity={"gpu": 1000},
            faults=faults,
        )
        assert isinstance(pub, Mute)
        keys = block_keys(list(range(1, 16 * BLOCK + 1)), BLOCK, "faulty-model")
        pub.stored(keys[:4])
        await pub.flush()
        await asyncio.sleep(2)

        async def make() -> None:
            pub.mute = True
            faults.only_seqs.add(pub.seq + 1)  # the next batch is lost on the way
            pub.stored(keys[4:8])
            await pub.flush()
            await asyncio.sleep(0.1)
            pub.stored(keys[8:12])  # ... and this one shows the gap
            await pub.flush()

        async def fix() -> None:
            pub.mute = False

        await self.fire_and_clear(
            "a lost batch that is neither replayed nor snapshotted",
            ["KvIndexInstanceDegraded"],
            make,
            fix,
            {"exported_instance": "faulty-0/0"},
        )
        await pub.close()

    async def dead_engine(self) -> None:
        """An engine that died while its sidecar still heartbeats, holding the shared prefixes: the
        proxy connects, fails, and retries the next instance (no alert: the upstream errors and
        retries show on the SLO dashboard)."""
        self.phase = "an engine down, its sidecar still heartbeating"
        self.log(f"{self.phase}: 15 s")
        self.timeline.append((f"{self.phase} (15 s)", round(time.time() - self.started, 1)))
        pub = await FaultyPublisher.connect(
            f"nats://127.0.0.1:{self.ports.nats}",
            worker="dead-0",
            model=MODEL,
            block_size=BLOCK,
            capacity={"gpu": 10_000},
            endpoint=f"127.0.0.1:{free_port()}",  # nothing listens there
        )
        for i in range(8):
            pub.stored(block_keys(prompt(self.rng, i, 16 * BLOCK, 0), BLOCK, MODEL))
        await pub.flush()
        await asyncio.sleep(15)
        await pub.close()

    async def index_paused(self) -> None:
        """The index stops answering for 2 s (SIGSTOP, then SIGCONT): the proxy's Score deadline (50 ms)
        passes and it routes by the fallback hash (no alert: the fallbacks show on the routing
        dashboard)."""
        self.phase = "the index paused for 2 s"
        self.log(self.phase)
        self.timeline.append((self.phase, round(time.time() - self.started, 1)))
        pid = self.procs["serve"].popen.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(2)
        finally:
            os.kill(pid, signal.SIGCONT)

    async def nats_down(self) -> None:
        async def make() -> None:
            self.procs["nats"].stop(timeout=10)

        async def fix() -> None:
            await asyncio.to_thread(self.start_nats)

        await self.fire_and_clear(
            "nats-server stopped", ["KvIndexNatsDisconnected", "KvIndexNotReady"], make, fix
        )

    async def overload(self) -> None:
        normal = self.load_rate

        async def make() -> None:
            self.long_prompts = True
            self.load_rate = self.args.overload_rate

        async def fix() -> None:
            self.long_prompts = False
            self.load_rate = normal

        await self.fire_and_clear(
            f"{MEDIUM_PROMPT:,}- and {LONG_PROMPT:,}-token prompts at {self.args.overload_rate:g}/s (several "
            "times the fleet's prefill capacity)",
            ["KvIndexShedding", "KvIndexGoodputLow"],
            make,
            fix,
        )

    # -- the dashboards' queries -------------------------------------------------------------------------

    def queries(self, start: float, end: float) -> list[dict[str, Any]]:
        out = []
        for board in DASHBOARDS:
            for title, q in board.queries():
                expr = q.expr.replace(RATE, RATE_INTERVAL)
                try:
                    result = self.prom.get(
                        "/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="2s"
                    )["result"]
                    error = ""
                except (OSError, RuntimeError) as exc:
                    result, error = [], str(exc)[:300]
                out.append(
                    {
                        "dashboard": board.uid,
                        "panel": title,
                        "expr": expr,
                        "series": len(result),
                        "error": error,
                    }
                )
        return out

    # -- the whole run ---------------------------------------------------------------------------------

    async def drive(self) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await self.wait_routable(http)
            self.tasks = [
                asyncio.create_task(self.proxy_load(http)),
                asyncio.create_task(self.picker_load(http)),
            ]
            self.log(
                f"load: {self.load_rate:g}/s through the proxy, {self.args.picker_rate:g}/s through the "
                "picker"
            )
            await asyncio.sleep(self.args.warmup)
            phases = (
                self.rejects,
                self.degraded,
                self.dead_engine,
                self.index_paused,
                self.nats_down,
                self.overload,
            )
            for phase in phases:
                await phase()
                self.phase = f"after: {self.phase}"
                await asyncio.sleep(self.args.settle)
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.sleep(3)  # the last scrapes
        end = time.time()
        return {"queries": self.queries(self.started, end), "fired": self.fired(self.started, end)}

    def fired(self, start: float, end: float) -> list[dict[str, Any]]:
        """Every alert that fired during the run (the ALERTS series), made for or not, and when."""
        expr = 'max by (alertname, exported_instance, reason, model) (ALERTS{alertstate="firing"})'
        result = self.prom.get(
            "/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1s"
        )
        out = []
        for series in result["result"]:
            times = [float(t) for t, _ in series["values"]]
            labels = {k: v for k, v in series["metric"].items() if k != "alertname"}
            out.append(
                {"alert": series["metric"]["alertname"], "labels": labels,
                 "from_s": round(min(times) - start, 1), "to_s": round(max(times) - start, 1),
                 "seconds": len(times)}
            )  # fmt: skip
        return sorted(out, key=lambda a: a["from_s"])

    async def wait_routable(self, http: aiohttp.ClientSession) -> None:
        url = f"http://127.0.0.1:{self.ports.route}/v1/models"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as r:
                    if MODEL in await r.text():
                        return
            for proc in self.procs.values():
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            await asyncio.sleep(0.5)
        raise RuntimeError("the proxy never listed the simulated model")

    def main(self) -> int:
        results: dict[str, Any] = {}
        ok = False
        try:
            committed = ROOT / "deploy" / "observability" / "alerts"
            self.start()
            results["promtool"] = {
                "check_rules": self.promtool("check", "rules", str(committed / "kvindex-rules.yaml")),
                "check_rules_prometheusrule_groups": self.check_crd_groups(committed),
                "test_rules": self.promtool("test", "rules", "kvindex-rules.test.yaml", cwd=committed),
            }
            self.log("promtool: rules checked, unit tests passed")
            results.update(asyncio.run(self.drive()))
            ok = self.report(results)
        finally:
            self.stop()
            results["events"] = [asdict(e) for e in self.events]
            results["timeline"] = self.timeline
            results["statuses"] = self.statuses
            results["notes"] = sorted(set(self.notes))[:20]
            results["wall_s"] = round(time.time() - self.started, 1)
            (self.out / "results.json").write_text(json.dumps(results, indent=1))
        return 0 if ok else 1

    def check_crd_groups(self, committed: Path) -> str:
        """promtool on the PrometheusRule's groups (its spec is a rules file's content)."""
        spec = yaml.safe_load((committed / "kvindex-prometheusrule.yaml").read_text())["spec"]
        path = self.out / "prometheusrule-groups.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return self.promtool("check", "rules", str(path))

    def report(self, results: dict[str, Any]) -> bool:
        queries = results["queries"]
        empty = [q for q in queries if not q["series"]]
        print(f"\nDashboard queries: {len(queries)} over {len(DASHBOARDS)} dashboards, "
              f"{len(queries) - len(empty)} returned series")  # fmt: skip
        for q in empty:
            print(f"  NO SERIES: {q['dashboard']} / {q['panel']}: {q['expr']} {q['error']}")
        print("\n| alert | fault | fired after (s) | cleared after (s) |\n|---|---|---|---|")
        for e in self.events:
            fired = f"{e.fired_s:.1f}" if e.fired_s is not None else "no"
            cleared = f"{e.cleared_s:.1f}" if e.cleared_s is not None else "no"
            print(f"| {e.alert} | {e.fault} | {fired} | {cleared} |")
        print("\nEvery alert that fired (ALERTS), seconds from the start of the run:")
        print("\n| alert | labels | from (s) | to (s) | firing (s) |\n|---|---|---|---|---|")
        for a in results["fired"]:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(a["labels"].items()))
            print(f"| {a['alert']} | {labels} | {a['from_s']} | {a['to_s']} | {a['seconds']} |")
        print("\nFaults, seconds from the start of the run:", ", ".join(f"{k} {v}" for k, v in self.timeline))
        print("\n| phase | proxy: HTTP status (requests) | picker |\n|---|---|---|")
        for phase, fronts in self.statuses.items():
            cells = [
                ", ".join(f"{c} ({n})" for c, n in sorted(fronts.get(f, {}).items()))
                for f in ("proxy", "picker")
            ]
            print(f"| {phase} | {cells[0]} | {cells[1]} |")
        bad_events = [e for e in self.events if e.fired_s is None or e.cleared_s is None]
        return not empty and not bad_events


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out-observability")
    p.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    p.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    p.add_argument("--workers", type=int, default=4, help="simulated engines")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s through the proxy")
    p.add_argument("--picker-rate", type=float, default=3.0, help="requests/s through the picker")
    p.add_argument("--overload-rate", type=float, default=12.0, help="long prompts/s in the overload")
    p.add_argument("--warmup", type=float, default=40.0, help="seconds of load before the first fault")
    p.add_argument("--settle", type=float, default=10.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for tool in (args.prometheus, args.promtool):
        if not shutil.which(tool):
            print(
                f"{tool} not found: make e2e-observability installs Debian's prometheus package",
                file=sys.stderr,
            )
            return 2
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
