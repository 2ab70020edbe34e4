"""TTFT on real engines: kvindex's routing proxy against vllm-router, same arrivals, several runs.

Two real vLLM engines (the CPU build, each pinned to its own core, KV events and prefix caching on,
a random Llama whose 2K-token prefill takes about a second) serve a chat workload — shared system
prompts, multi-turn sessions, long documents asked about repeatedly — sent with the official
``openai`` client at fixed, seeded arrival times. The same arrivals go through each router:

- ``kvindex``: ``kvindex serve`` (the model's tokenizer) serving the OpenAI proxy in its own process
  (``--route-port``; ``--kvindex-proxy process`` runs ``kvindex route`` apart, over gRPC) + one
  ``kvshim vllm`` per engine (policy ttft), with the prefill model calibrated from the engines (a warm-up run
  before the measured ones; the calibration persists in the NATS KV bucket of a nats-server kept for
  the whole invocation, as in a deployment);
- ``kvindex-default``: the same with ``kvindex serve --no-calibration`` (the default prefill model);
- ``kvindex-process``: the same with ``kvindex route`` as its own process, over gRPC (the placement
  of the proxy, A/B'd on the same arrivals);
- ``vllm-router`` 0.1.17 (Rust, PyPI ``vllm-router``, not ours) with ``--policy kv_aware`` (it reads
  the engines' KV events itself), ``cache_aware`` and ``round_robin``.

Between runs every engine's prefix cache is reset, so each run starts cold. Reported per router and
load: TTFT mean / p50 / p90 at the client (time to the first streamed content chunk), the engines'
own prefix-cache hit rate (``vllm:prefix_cache_hits_total`` / ``queries``), completed requests/s, and
the CPU share of everything that is not an engine while it ran. For kvindex, also predicted against
actual: the index's ``kvindex_prediction_*`` metrics (outcomes, the cached-token error and the TTFT
ratio histograms) and, per request, the client's TTFT over the estimate the proxy returns
(``x-kvindex-est-ttft-ms``). ``make e2e-routing`` runs it; docs/e2e-routing.md explains the method
and shows the tables.

SLO goodput: every request carries a TTFT objective (header ``x-kvindex-ttft-slo-ms``; ``--slo-ms``,
by default 2.5x this machine's cold 2K-token prefill, about 4x the light-load p90), which
``kvindex route`` admits, queues or sheds by (kvindex/scoring/admission.py) and vllm-router ignores.
Goodput is the requests whose TTFT met it over all arrivals: a shed (429) or failed request missed
it. The ``overload`` level offers more than the engines can serve.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot_results
from run_vllm import Proc, engine_metrics, free_port, http, wait_log_event

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "routing-llama"
BLOCK = 32  # vLLM's CPU attention backend takes multiples of 32
ROUTERS = ("kvindex", "kvindex-default", "kvindex-process", "kv_aware", "cache_aware", "round_robin")
KVINDEX = ["kvindex", "kvindex-default", "kvindex-process"]  # (+ the --variant routers)
# --variant NAME=OPTION,...: kvindex (calibrated) with `serve --policy-option OPTION` each, as one
# more router on the same arrivals (a same-invocation A/B of a policy parameter).
VARIANTS: dict[str, list[str]] = {}


# -- the workload ------------------------------------------------------------------------------------


@dataclass
class Request:
    at: float  # seconds after the run starts
    kind: str  # system | session | document
    messages: list[dict[str, str]]
    group: str  # the shared part it reuses (system prompt, session, document)


class Text:
    """Prose-like filler sized in tokens of the model's own tokenizer (the fixture's word salad)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        from kvtools.testing.tokenizer_fixtures import corpus

        self.words = sorted({w for line in corpus(600) for w in line.split()})
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        sample = " ".join(random.Random(0).choices(self.words, k=4000))
        self.tokens_per_word = len(tok.encode(sample, add_special_tokens=False).ids) / 4000

    def __call__(self, rng: random.Random, n_tokens: int) -> str:
        return " ".join(rng.choices(self.words, k=max(1, round(n_tokens / self.tokens_per_word))))


def workload(seed: int, rate: float, duration: float, words: Text) -> list[Request]:
    """Seeded arrivals (Poisson at ``rate``) over three request kinds sharing prefixes."""
    rng = random.Random(seed)
    systems = [words(rng, 700) for _ in range(4)]
    documents = [words(rng, 1600) for _ in range(6)]
    session_system = words(rng, 400)
    sessions: list[dict[str, Any]] = []
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        kind = rng.choices(("system", "session", "document"), weights=(0.35, 0.35, 0.30))[0]
        if kind == "system":
            s = rng.randrange(len(systems))
            msgs = [
                {"role": "system", "content": systems[s]},
                {"role": "user", "content": words(rng, rng.randint(30, 120))},
            ]
            out.append(Request(t, kind, msgs, f"system{s}"))
        elif kind == "document":
            d = rng.randrange(len(documents))
            msgs = [
                {"role": "user", "content": "document: " + documents[d]},
                {"role": "user", "content": words(rng, rng.randint(20, 60))},
            ]
            out.append(Request(t, kind, msgs, f"doc{d}"))
        else:
            # A session grows by one turn (the previous answer stands in as fixed words) per request.
            live = [s for s in sessions if s["turns"] < 5]
            if not live or rng.random() < 0.3:
                sess = {
                    "id": len(sessions),
                    "turns": 0,
                    "msgs": [{"role": "system", "content": session_system}],
                }
                sessions.append(sess)
            else:
                sess = rng.choice(live)
            sess["msgs"] = [
                *sess["msgs"],
                {"role": "user", "content": words(rng, rng.randint(60, 200))},
            ]
            out.append(Request(t, kind, list(sess["msgs"]), f"session{sess['id']}"))
            sess["msgs"].append({"role": "assistant", "content": words(rng, 16)})
            sess["turns"] += 1


# -- measurement -----------------------------------------------------------------------------------


@dataclass
class Result:
    at: float
    kind: str
    ttft: float | None  # seconds; None: failed
    total: float | None
    error: str = ""
    status: int | None = None  # HTTP status of a failed request (429: shed by admission)
    est_ttft: float | None = None  # seconds: what the index estimated (kvindex route's header)
    instance: str = ""


async def send_all(
    base_url: str, requests: list[Request], max_tokens: int, headers: dict[str, str] | None = None
) -> list[Result]:
    """Each request at its arrival time, streamed; TTFT = first chunk with content (or a finish)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()

    async def one(req: Request) -> Result:
        delay = req.at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        ttft = None
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=req.messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_headers=headers,
            )
            est = raw.headers.get("x-kvindex-est-ttft-ms")
            instance = raw.headers.get("x-kvindex-instance", "")
            stream = raw.parse()
            async for chunk in stream:
                if (
                    ttft is None
                    and chunk.choices
                    and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason)
                ):
                    ttft = time.perf_counter() - sent
            total = time.perf_counter() - sent
            return Result(
                req.at, req.kind, ttft, total, est_ttft=float(est) / 1000 if est else None, instance=instance
            )
        except Exception as exc:  # a failed request is reported, not retried
            error = f"{type(exc).__name__}: {exc}"[:200]
            return Result(req.at, req.kind, None, None, error, getattr(exc, "status_code", None))

    results = await asyncio.gather(*(one(r) for r in requests))
    await client.close()
    return list(results)


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process and its threads (clock ticks); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (vLLM forks its engine core)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def machine_ticks() -> int:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(x) for x in parts[:3]) + sum(
        int(x) for x in parts[5:8]
    )  # busy: user nice system irq softirq steal


# -- the parts ---------------------------------------------------------------------------------------


@dataclass
class Engine:
    n: int
    http_port: int
    zmq_port: int
    replay_port: int
    proc: Proc | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.engines = [Engine(i, free_port(), free_port(), free_port()) for i in range(2)]
        self.procs: list[Proc] = []
        self.words = Text(args.model_dir)
        self.calibration: dict[str, float] = {}
        self.slo_s = args.slo_ms / 1000.0  # 0: set from the calibration
        self.nats: Proc | None = None  # kvindex's nats-server: its KV bucket keeps the calibration
        self.nats_url = ""
        self.index: tuple[int, int] | None = None  # the running kvindex serve's gRPC and metrics ports
        self.warmup: dict[str, Any] = {}

    def start_nats(self) -> str:
        """One nats-server (JetStream, its store in the output folder) for every kvindex run: the
        prefill calibration persists in its bucket from run to run, as across restarts in a deployment."""
        if self.nats is None:
            from kvindex.service.natsd import nats_server_binary

            store = self.out / "nats-store"
            shutil.rmtree(store, ignore_errors=True)  # every invocation starts uncalibrated
            port = free_port()
            self.nats = Proc(
                "nats-server",
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
                self.out / "nats-server.log",
            )
            self.procs.append(self.nats)
            self.nats_url = f"nats://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(OSError):
                    import socket

                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                if time.monotonic() > deadline or not self.nats.alive():
                    raise RuntimeError(f"nats-server did not start:\n{self.nats.tail(20)}")
                time.sleep(0.1)
        return self.nats_url

    def log(self, msg: str) -> None:
        print(f"[e2e-routing {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def start_engines(self) -> None:
        a = self.args
        for eng in self.engines:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{eng.zmq_port}",
                "replay_endpoint": f"tcp://*:{eng.replay_port}",
                "topic": "kv-events",
            }
            argv = [
                "taskset", "-c", str(eng.n), str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(a.model_dir), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(eng.http_port),
                "--dtype", "float32", "--seed", "0", "--max-model-len", "8192",
                "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--num-gpu-blocks-override", str(a.cache_blocks),
                "--kv-cache-memory-bytes", str(512 << 20),
                "--max-num-batched-tokens", "8192", "--max-num-seqs", "16",
                "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events),
                # vllm-router's kv_aware asks the engine to render and tokenize each chat request
                # (/v1/chat/completions/render), which vLLM serves only with scale-out enabled.
                "--enable-scale-out",
            ]  # fmt: skip
            env = {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(eng.n),
                "OMP_NUM_THREADS": "1",
                "VLLM_LOGGING_LEVEL": "WARNING",
                # vLLM seeds its block hashes from PYTHONHASHSEED (random without it); vllm-router's
                # kv_aware recomputes engine hashes with hash seed 0, so both must agree on it.
                "PYTHONHASHSEED": "0",
            }
            eng.proc = Proc(f"vllm{eng.n}", argv, self.out / f"vllm{eng.n}.log", env)
            self.procs.append(eng.proc)
        deadline = time.monotonic() + a.startup_timeout
        for eng in self.engines:
            assert eng.proc is not None
            while True:
                if not eng.proc.alive():
                    raise RuntimeError(f"vLLM {eng.n} exited:\n{eng.proc.tail(40)}")
                with contextlib.suppress(OSError):
                    if http(f"{eng.base}/health", timeout=2)[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM {eng.n} not healthy in time:\n{eng.proc.tail(40)}")
                time.sleep(0.5)
        self.log(f"engines up: {[e.base for e in self.engines]}")

    def reset_engines(self) -> None:
        for eng in self.engines:
            status, body = http(f"{eng.base}/reset_prefix_cache", {})
            if status != 200:
                raise RuntimeError(f"reset_prefix_cache on engine {eng.n}: {status} {body[:200]!r}")
            # vLLM publishes the reset's AllBlocksCleared event with the engine's next step: until
            # a request runs, a bridge started now replays the previous run's stored blocks as if
            # they were cached, and every event-fed router starts the run on them (measured: the
            # first second's cold prompts estimated as hits). One tiny request (shorter than a block,
            # so it caches nothing) publishes the event before the router starts.
            tiny = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            status, body = http(f"{eng.base}/v1/completions", tiny)
            if status != 200:
                raise RuntimeError(f"flushing engine {eng.n}'s events: {status} {body[:200]!r}")

    def start_router(self, name: str) -> tuple[str, list[Proc]]:
        """Start one router in front of the engines; its OpenAI base URL and its processes."""
        procs: list[Proc] = []
        try:
            return self._start_router(name, procs)
        except BaseException:
            for p in reversed(procs):  # whatever started before the failure goes too
                p.stop()
            raise

    def _start_router(self, name: str, procs: list[Proc]) -> tuple[str, list[Proc]]:
        port = free_port()
        if name in KVINDEX:
            placement = getattr(self.args, "kvindex_proxy", "in-process")
            in_process = name != "kvindex-process" and placement == "in-process"
            grpc_port, metrics_port = free_port(), free_port()
            nats = self.start_nats()
            serve = Proc(
                "kvindex",
                [
                    str(BIN / "kvindex"), "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
                    "--metrics-port", str(metrics_port), "--log-format", "json", "--log-level", "info",
                    "--tokenizer", f"{MODEL}={self.args.model_dir}", "--nats", nats, "--no-routing-sync",
                    *(["--no-calibration"] if name == "kvindex-default" else []),
                    *[a for opt in VARIANTS.get(name, []) for a in ("--policy-option", opt)],
                    *(["--route-host", "127.0.0.1", "--route-port", str(port)] if in_process else []),
                ],
                self.out / "kvindex.log",
            )  # fmt: skip
            procs.append(serve)
            wait_log_event(serve.log_path, "kvindex_serving", serve, 30)
            self.index = (grpc_port, metrics_port)
            for eng in self.engines:
                procs.append(
                    Proc(
                        f"kvshim{eng.n}",
                        [
                            str(BIN / "kvshim"), "vllm",
                            "--zmq", f"tcp://127.0.0.1:{eng.zmq_port}",
                            "--replay", f"tcp://127.0.0.1:{eng.replay_port}",
                            "--topic", "kv-events", "--metrics-url", f"{eng.base}/metrics",
                            "--worker-id", f"vllm{eng.n}", "--model", MODEL, "--block-size", str(BLOCK),
                            "--nats", nats, "--log-format", "json", "--log-level", "warning",
                        ],
                        self.out / f"kvshim{eng.n}.log",
                    )
                )  # fmt: skip
            if not in_process:
                route = Proc(
                    "route",
                    [
                        str(BIN / "kvindex"), "route", "--index", f"127.0.0.1:{grpc_port}",
                        "--host", "127.0.0.1", "--port", str(port),
                        "--log-format", "json", "--log-level", "warning",
                    ],
                    self.out / "route.log",
                )  # fmt: skip
                procs.append(route)
            self.wait_instances(grpc_port)
        else:
            argv = [
                str(self.args.vllm_router), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *[e.base for e in self.engines], "--policy", name,
                "--log-level", self.args.router_log_level, "--disable-retries",
                "--prometheus-port", str(free_port()),  # its default port may still be held
            ]  # fmt: skip
            if name == "kv_aware":
                for eng in self.engines:
                    argv += ["--kv-event-source", f"{eng.base}=tcp://127.0.0.1:{eng.zmq_port}"]
                argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
            # kv_aware tokenizes the request text itself: it needs the model's tokenizer directory.
            env = {"VLLM_ROUTER_TOKENIZER": str(self.args.model_dir)}
            procs.append(Proc(f"vllm-router-{name}", argv, self.out / f"vllm-router-{name}.log", env))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.tail(30)}")
            with contextlib.suppress(OSError):
                if http(f"{base}/v1/models", timeout=2)[0] == 200:
                    return base, procs
            time.sleep(0.3)
        raise RuntimeError(
            f"router {name} not answering /v1/models:\n" + "\n".join(p.tail(10) for p in procs)
        )

    def wait_instances(self, grpc_port: int) -> None:
        import grpc

        from kvindex.v1 import kvindex_pb2 as pb
        from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            stub = pb_grpc.KvIndexStub(ch)
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):
                    got = stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=2).instances
                    if len(got) == len(self.engines) and all(i.endpoint for i in got):
                        return
                time.sleep(0.3)
        raise RuntimeError("the engines' shims did not register with the index in time")

    def prediction(self) -> dict[str, Any]:
        """The index's predicted-against-actual metrics and its instances' prefill models now."""
        import grpc

        from kvindex.v1 import kvindex_pb2 as pb
        from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

        assert self.index is not None
        grpc_port, metrics_port = self.index
        _, body = http(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        out = prediction_metrics(body.decode())
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            got = pb_grpc.KvIndexStub(ch).ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=5)
        out["instances"] = {
            i.instance_id: {
                "state": i.state,
                "prefill": {
                    "source": i.prefill.source,
                    "a_ms": i.prefill.a_ms,
                    "b_ms_per_token": i.prefill.b_ms_per_token,
                    "c_ms_per_token2": i.prefill.c_ms_per_token2,
                    "samples": i.prefill.samples,
                    "error": i.prefill.error if i.prefill.has_error else None,
                },
                "outcomes": [i.outcomes_exact, i.outcomes_over, i.outcomes_under],
            }
            for i in got.instances
        }
        return out

    def run_once(
        self, router: str, load: str, rate: float, run: int, seed: int | None = None
    ) -> dict[str, Any]:
        self.reset_engines()
        base, procs = self.start_router(router)
        requests = workload(
            self.args.seed + run if seed is None else seed, rate, self.args.duration, self.words
        )
        before = [engine_metrics(e.base) for e in self.engines]
        served_before = [served(e.base) for e in self.engines]
        engine_pids = [p for e in self.engines if e.proc for p in tree_pids(e.proc.popen.pid)]
        ticks0, engine0, wall0 = machine_ticks(), sum(cpu_ticks(p) for p in engine_pids), time.monotonic()
        objective = {"x-kvindex-ttft-slo-ms": f"{self.slo_s * 1000:.0f}"} if self.slo_s else None
        results = asyncio.run(send_all(base + "/v1", requests, self.args.max_tokens, objective))
        wall = time.monotonic() - wall0
        busy = machine_ticks() - ticks0
        engines_busy = sum(cpu_ticks(p) for p in engine_pids) - engine0
        after = [engine_metrics(e.base) for e in self.engines]
        served_after = [served(e.base) for e in self.engines]
        prediction = None
        if router in KVINDEX:
            time.sleep(1.0)  # the proxy's last releases (with their reports) are sent in the background
            prediction = self.prediction()
        for p in procs:
            p.stop()
        hits = sum(
            a.get("prefix_cache_hits_total", 0) - b.get("prefix_cache_hits_total", 0)
            for a, b in zip(after, before, strict=True)
        )
        queries = sum(
            a.get("prefix_cache_queries_total", 0) - b.get("prefix_cache_queries_total", 0)
            for a, b in zip(after, before, strict=True)
        )
        per_engine = [a - b for a, b in zip(served_after, served_before, strict=True)]
        ok = [r for r in results if r.ttft is not None]
        ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
        hz = os.sysconf("SC_CLK_TCK")
        row = {
            "router": router,
            "load": load,
            "rate": rate,
            "run": run,
            "requests": len(results),
            "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50": pct(ttfts, 50),
            "ttft_p90": pct(ttfts, 90),
            "hit_rate": hits / queries if queries else None,
            "req_per_s": len(ok) / wall,
            "wall_s": wall,
            "per_engine": per_engine,
            "cpu_other_share": (busy - engines_busy) / max(busy, 1),
            "cpu_busy_cores": busy / hz / wall,
            # Goodput: within the objective, over every arrival (shed and failed ones missed it).
            "duration_s": self.args.duration,
            "slo_s": self.slo_s,
            "slo_met": sum(1 for r in ok if r.ttft is not None and r.ttft <= self.slo_s),
            "shed": sum(1 for r in results if r.status == 429),
            "prediction": prediction,
            "results": [asdict(r) for r in results],
        }
        self.log(
            f"{router:12s} {load:5s} run {run}: TTFT mean {fmt(row['ttft_mean'])} p50 {fmt(row['ttft_p50'])} "
            f"p90 {fmt(row['ttft_p90'])}, hit {fmt(row['hit_rate'], pct_=True)}, "
            f"{row['req_per_s']:.2f} req/s, "
            f"failed {row['failed']} (shed {row['shed']}), goodput {row['slo_met']}/{len(results)} within "
            f"{self.slo_s:.2f}s, per engine {per_engine}, other CPU {row['cpu_other_share']:.0%}"
        )
        if prediction is not None:
            ratios = client_ratios([row])
            got = prediction["outcomes"]
            n = sum(got.values())
            fits = {k: v["prefill"].get("source", "") for k, v in prediction["instances"].items()}
            p90 = quantile([abs(math.log(r)) for r in ratios], 0.9)
            self.log(
                f"{'':12s} predicted: exact {got.get('exact', 0)}/{n}, over {got.get('over', 0)}, "
                f"under {got.get('under', 0)}; TTFT/estimate median {fmt_num(quantile(ratios, 0.5))}, "
                f"p90 |ln| {fmt_num(p90)}; prefill models {fits}"
            )
        return row

    def calibrate(self) -> dict[str, float]:
        """Offered loads from this machine's prefill speed: a cold 2K-token prompt's TTFT on one engine
        gives the time per prompt token, hence what two engines can prefill with no cache hits at the
        workload's mean prompt length. "light" offers 20 % of that, "high" 80 % and "peak" 140 %:
        with the 62-66 % of prompt tokens round robin gets from the cache here, its engines' queues
        build at peak without running away (measured: 2.5x that overloads them). "overload" offers
        600 %: past what the engines prefill even with the 83 % of prompt tokens a cache-aware router
        got from the cache at peak (no-hit capacity / 0.17 ~ 5.9x, before any decode step). The TTFT
        objective (unless ``--slo-ms``): 2.5x the 2K-token prefill, about 4x the light-load p90
        measured before."""
        rng = random.Random(12345)
        samples = []
        for _ in range(4):
            req = Request(0.0, "calibration", [{"role": "user", "content": self.words(rng, 2048)}], "")
            (res,) = asyncio.run(send_all(self.engines[0].base + "/v1", [req], 1))
            if res.ttft is None:
                raise RuntimeError(f"calibration request failed: {res.error}")
            samples.append(res.ttft)
        # The engine's first prompt of a new length is slower (its kernels are set up for the shape):
        # that one is not a measure of its speed (seen: 0.46 s first, 0.22 s after, on the same VM).
        samples = samples[1:]
        per_token = statistics.median(samples) / 2048
        probe = workload(self.args.seed, 1.0, 600.0, self.words)
        mean_tokens = statistics.fmean(
            sum(len(m["content"].split()) for m in r.messages) * self.words.tokens_per_word for r in probe
        )
        capacity = len(self.engines) / (mean_tokens * per_token)  # requests/s, no cache hits
        if not self.slo_s:
            self.slo_s = round(2.5 * statistics.median(samples), 2)
        self.calibration = {
            "prefill_2k_s": statistics.median(samples),
            "mean_prompt_tokens": mean_tokens,
            "capacity_req_s_no_hits": capacity,
            "slo_s": self.slo_s,
        }
        self.log(
            f"calibration: 2K-token prefill {self.calibration['prefill_2k_s']:.3f} s, mean prompt "
            f"{mean_tokens:.0f} tokens, two engines prefill {capacity:.2f} req/s with no cache hits"
        )
        return {
            "light": self.args.light_rate or round(0.2 * capacity, 2),
            "high": self.args.high_rate or round(0.8 * capacity, 2),
            "peak": self.args.peak_rate or round(1.4 * capacity, 2),
            "overload": self.args.overload_rate or round(6.0 * capacity, 2),
        }

    def calibrate_kvindex(self, rate: float) -> None:
        """Calibrate kvindex's prefill models before the measured runs: rounds of light load (arrivals
        of their own seeds) until every instance is ranked with a fitted model, at most 4; the bucket
        keeps the calibration for every later kvindex run."""
        a = self.args
        duration, a.duration = a.duration, a.warmup
        rows = []
        try:
            for round_ in range(4):
                rows.append(self.run_once("kvindex", "warmup", rate, -1, seed=a.seed + 1000 + round_))
                sources = {i["prefill"]["source"] for i in rows[-1]["prediction"]["instances"].values()}
                if "default" not in sources:
                    break
        finally:
            a.duration = duration
        # One row for the tables: the rounds' requests and counts together, the last round's models.
        self.warmup = dict(rows[-1])
        self.warmup["results"] = [r for row in rows for r in row["results"]]
        self.warmup["rounds"] = len(rows)
        merged = dict(rows[-1]["prediction"])
        for key in ("outcomes", "error", "ratio"):
            merged[key] = {}
            for row in rows:
                for k, v in row["prediction"][key].items():
                    merged[key][k] = merged[key].get(k, 0) + v
        self.warmup["prediction"] = merged
        # The real-engine check of both sample sources: an instance's samples beyond the requests
        # reported for it came from its shim (vLLM's prefill-time histograms, in heartbeats).
        for name, info in sorted(merged["instances"].items()):
            fit = info["prefill"]
            reported = sum(
                sum(row["prediction"]["instances"].get(name, {}).get("outcomes", ())) for row in rows
            )
            self.log(
                f"calibrated {name}: {fit['source']} model a={fit['a_ms']:.1f} ms "
                f"b={fit['b_ms_per_token']:.4f} ms/token c={fit['c_ms_per_token2']:.2e}, {fit['samples']} "
                f"samples ({reported} requests reported: {fit['samples'] - reported} or more from the "
                f"engine), recent error {fit['error']}"
            )
            if fit["samples"] <= reported:
                raise RuntimeError(f"{name}: no prefill samples from the engine's /metrics reached the index")

    def main(self) -> int:
        a = self.args
        rows: list[dict[str, Any]] = []
        try:
            self.start_engines()
            # Warm the engines' code paths once (not measured) so the first run is not penalised.
            asyncio.run(send_all(self.engines[0].base + "/v1", workload(999, 1.0, 2.0, self.words), 4))
            asyncio.run(send_all(self.engines[1].base + "/v1", workload(998, 1.0, 2.0, self.words), 4))
            rates = self.calibrate()
            self.reset_engines()
            if "kvindex" in a.routers and a.warmup > 0:
                self.calibrate_kvindex(rates["light"])
            for run in range(a.runs):
                for load in a.loads:
                    # Routers in a rotating order so that no router always runs first or last.
                    order = list(a.routers[run % len(a.routers) :]) + list(a.routers[: run % len(a.routers)])
                    for router in order:
                        rows.append(self.run_once(router, load, rates[load], run))
                        (self.out / "results.json").write_text(
                            json.dumps(
                                {"calibration": self.calibration, "warmup": self.warmup, "runs": rows},
                                indent=1,
                            )
                        )
        finally:
            for p in reversed(self.procs):
                p.stop()
        table = summary(rows, self.calibration) + paired_summary(rows) + "\n" + p90_summary(rows)
        table += "\n" + predictions(rows, self.warmup)
        table += "\n" + goodput_summary(rows)
        (self.out / "table.md").write_text(table)
        print(table)
        for png in plot_results.write_plots(self.out / "results.json"):  # TTFT, goodput, estimates
            self.log(f"plot: {png}")
        return 0


def served(base: str) -> int:
    """Requests an engine finished (``vllm:request_success_total`` summed over its labels)."""
    _, body = http(f"{base}/metrics", timeout=5)
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


ROUTER_NAMES = {
    "kvindex": "kvindex route (ttft, calibrated)",
    "kvindex-default": "kvindex route (ttft, default model)",
    "kvindex-process": "kvindex route as its own process (ttft, calibrated)",
}

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def prediction_metrics(text: str) -> dict[str, Any]:
    """kvindex_prediction_*: outcomes, and the two histograms' bucket counts (not cumulative) summed
    over instances, keyed by upper edge (the error's edges are in tokens: one block size here)."""
    outcomes: dict[str, float] = {}
    cumulative: dict[str, dict[str, dict[float, float]]] = {"error": {}, "ratio": {}}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels = m.group(1), dict(_LABEL.findall(m.group(2) or ""))
        value = float(m.group(3))
        if name == "kvindex_prediction_outcomes_total":
            outcomes[labels["outcome"]] = value
        for key, family in (
            ("error", "kvindex_prediction_cached_tokens_error_bucket"),
            ("ratio", "kvindex_prediction_ttft_ratio_bucket"),
        ):
            if name == family:
                edge = math.inf if labels["le"] == "+Inf" else float(labels["le"])
                cumulative[key].setdefault(labels["instance"], {})[edge] = value
    out: dict[str, Any] = {"outcomes": outcomes}
    for key, per in cumulative.items():
        counts: dict[float, float] = {}
        for series in per.values():
            prev = 0.0
            for edge in sorted(series):
                counts[edge] = counts.get(edge, 0.0) + series[edge] - prev
                prev = series[edge]
        out[key] = {("+Inf" if e == math.inf else repr(e)): n for e, n in sorted(counts.items())}
    return out


def client_ratios(rows: list[dict[str, Any]]) -> list[float]:
    """Per request: the client's TTFT over the estimate kvindex route returned with the answer."""
    return [
        r["ttft"] / r["est_ttft"]
        for row in rows
        for r in row["results"]
        if r.get("ttft") and r.get("est_ttft")
    ]


def quantile(xs: list[float], q: float) -> float | None:
    return pct(sorted(xs), q * 100)


def fmt_num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def histogram_quantile(counts: dict[str, float], q: float) -> str:
    """The bucket holding quantile ``q`` of a histogram given as {upper edge: count}: "(lo, hi]"."""
    total = sum(counts.values())
    if not total:
        return "-"
    seen, lo = 0.0, "-inf"
    for edge, n in counts.items():
        seen += n
        if seen >= q * total:
            return f"({lo}, {edge}]"
        lo = edge
    return "-"


def predictions(rows: list[dict[str, Any]], warmup: dict[str, Any]) -> str:
    """kvindex's predictions against what the engines did, per load and prefill model."""
    sel = [r for r in rows if r["router"] in KVINDEX and r.get("prediction")]
    if not sel:
        return ""
    lines = [
        "### kvindex: predicted against actual",
        "",
        "Cached tokens: the engine's `usage.prompt_tokens_details.cached_tokens` against the index's",
        "prediction for the chosen instance (`kvindex_prediction_outcomes_total`). TTFT ratio: the",
        "client's TTFT over the estimate `kvindex route` returned (`x-kvindex-est-ttft-ms`), per",
        "request; the index's own histogram (`kvindex_prediction_ttft_ratio`, the proxy's TTFT) gives",
        "the bucket of its median.",
        "",
        "| load | prefill model | requests reported | exact | over | under | TTFT ratio p10 / median / p90 "
        "| p90 of \\|ln ratio\\| | index histogram median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = [("warmup", "kvindex", [warmup])] if warmup.get("prediction") else []
    for load in dict.fromkeys(r["load"] for r in sel):
        for router in KVINDEX:
            rr = [r for r in sel if r["load"] == load and r["router"] == router]
            if rr:
                groups.append((load, router, rr))
    for load, router, rr in groups:
        outcomes: dict[str, float] = {}
        ratio_hist: dict[str, float] = {}
        for r in rr:
            for k, v in r["prediction"]["outcomes"].items():
                outcomes[k] = outcomes.get(k, 0) + v
            for k, v in r["prediction"]["ratio"].items():
                ratio_hist[k] = ratio_hist.get(k, 0) + v
        n = sum(outcomes.values())
        ratios = client_ratios(rr)
        logs = [abs(math.log(x)) for x in ratios]
        model = "default" if router == "kvindex-default" else "calibrated"
        if router == "kvindex-process":
            model += " (the proxy as its own process)"
        if router in VARIANTS:
            model += f" ({', '.join(VARIANTS[router])})"
        if load == "warmup":
            model = "learning (from the default)"
        share = {k: f"{outcomes.get(k, 0) / n:.1%}" if n else "-" for k in ("exact", "over", "under")}
        lines.append(
            f"| {load} | {model} | {int(n)} | {share['exact']} | {share['over']} | {share['under']} | "
            f"{fmt_num(quantile(ratios, 0.1))} / {fmt_num(quantile(ratios, 0.5))} / "
            f"{fmt_num(quantile(ratios, 0.9))} | {fmt_num(quantile(logs, 0.9))} | "
            f"{histogram_quantile(ratio_hist, 0.5)} |"
        )
    lines += ["", "Cached-token error (engine - predicted, tokens; block = 32), requests per bucket:", ""]
    edges: list[str] = []
    for _load, _router, rr in groups:
        for r in rr:
            edges += [e for e in r["prediction"]["error"] if e not in edges]
    edges.sort(key=lambda e: math.inf if e == "+Inf" else float(e))
    if edges:
        lines += [
            "| load | prefill model | " + " | ".join(f"≤ {e}" for e in edges) + " |",
            "|---|---|" + "---|" * len(edges),
        ]
        for load, router, rr in groups:
            hist = {e: sum(r["prediction"]["error"].get(e, 0) for r in rr) for e in edges}
            model = "default" if router == "kvindex-default" else "calibrated"
            if router in VARIANTS:
                model += f" ({', '.join(VARIANTS[router])})"
            lines.append(
                f"| {load} | {model if load != 'warmup' else 'learning'} | "
                + " | ".join(str(int(hist[e])) for e in edges)
                + " |"
            )
    fits = (warmup.get("prediction") or {}).get("instances", {})
    last = next((r for r in reversed(sel) if r["router"] == "kvindex"), None)
    if last is not None:
        fits = last["prediction"]["instances"]
    if fits:
        lines += [
            "",
            "Prefill models in use at the end (ListInstances `prefill`):",
            "",
            "| instance | source | a (ms) | b (ms/token) | c (ms/token²) | samples | recent error |",
            "|---|---|---|---|---|---|---|",
        ]
        for inst, info in sorted(fits.items()):
            f = info["prefill"]
            lines.append(
                f"| {inst} | {f.get('source', '')} | {f.get('a_ms', 0):.1f} | "
                f"{f.get('b_ms_per_token', 0):.4f} | {f.get('c_ms_per_token2', 0):.2e} | "
                f"{f.get('samples', 0)} | {fmt_num(f.get('error'), 3)} |"
            )
    lines.append("")
    return "\n".join(lines)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def fmt(x: float | None, pct_: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if pct_ else f"{x:.3f}s"


def summary(rows: list[dict[str, Any]], calibration: dict[str, float]) -> str:
    """Per load and router: the mean over runs, and the spread (min-max) across runs."""
    lines = []
    if calibration:
        lines += [
            f"Calibration: a cold 2K-token prefill took {calibration['prefill_2k_s']:.3f} s on one engine; "
            f"mean prompt {calibration['mean_prompt_tokens']:.0f} tokens; two engines prefill "
            f"{calibration['capacity_req_s_no_hits']:.2f} requests/s with no cache hits.",
            "",
        ]
    for load in dict.fromkeys(r["load"] for r in rows):
        sel = [r for r in rows if r["load"] == load]
        rate = ", ".join(str(x) for x in dict.fromkeys(r["rate"] for r in sel))
        lines += [
            f"### {load} load ({rate} req/s offered, {len({r['run'] for r in sel})} runs)",
            "",
            "| router | TTFT mean (s) | TTFT p50 (s) | TTFT p90 (s) | TTFT p90, pooled (s) "
            "| prefix-cache hit | req/s | failed | other CPU |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for router in dict.fromkeys(r["router"] for r in sel):
            rr = [r for r in sel if r["router"] == router]

            def cell(key: str, pct_: bool = False, rr: list[dict[str, Any]] = rr) -> str:
                vals = [r[key] for r in rr if r[key] is not None]
                if not vals:
                    return "-"
                mean = statistics.fmean(vals)
                if pct_:
                    return f"{mean:.1%} ({min(vals):.1%}-{max(vals):.1%})"
                return f"{mean:.3f} ({min(vals):.3f}-{max(vals):.3f})"

            # The p90 of every request of every run together: with a few dozen requests per run, a
            # run's own p90 is one request (its third-slowest), and their mean follows the luckiest runs.
            pooled = pct(sorted(x["ttft"] for r in rr for x in r["results"] if x["ttft"] is not None), 90)
            name = ROUTER_NAMES.get(router, f"vllm-router {router}")
            lines.append(
                f"| {name} | {cell('ttft_mean')} | {cell('ttft_p50')} | {cell('ttft_p90')} | "
                f"{'-' if pooled is None else f'{pooled:.3f}'} | "
                f"{cell('hit_rate', True)} | {statistics.fmean(r['req_per_s'] for r in rr):.2f} | "
                f"{sum(r['failed'] for r in rr)} | {statistics.fmean(r['cpu_other_share'] for r in rr):.0%} |"
            )
        lines.append("")
    return "\n".join(lines)


def run_pairs(
    rows: list[dict[str, Any]], ours: str
) -> Iterator[tuple[str, str, list[list[tuple[float, float]]]]]:
    """Per load and router other than ``ours``: for each run both served, the (ours, theirs) TTFT of
    every arrival both answered (each run sends the same arrivals through every router)."""
    for load in dict.fromkeys(r["load"] for r in rows):
        sel = [r for r in rows if r["load"] == load]
        mine = {r["run"]: r for r in sel if r["router"] == ours}
        for router in dict.fromkeys(r["router"] for r in sel):
            if router == ours:
                continue
            runs = []
            for r in sel:
                m = mine.get(r["run"]) if r["router"] == router else None
                if m is None:
                    continue
                pairs = [
                    (a["ttft"], b["ttft"])
                    for a, b in zip(m["results"], r["results"], strict=True)
                    if a["ttft"] is not None and b["ttft"] is not None
                ]
                if pairs:
                    runs.append(pairs)
            yield load, router, runs


def paired_summary(rows: list[dict[str, Any]], ours: str = "kvindex") -> str:
    """``ours`` against every other router, request by request: each run sends the same arrivals
    through every router, so the TTFT of one request under two routers is a pair. Per load and
    router: the mean difference (ours - theirs) with a 95 % bootstrap interval over the pairs, the
    share of requests ours served faster, and the runs whose mean was lower. Requests in a run share
    queues, so they are not independent: read the interval as optimistic, the runs column as the
    check."""
    rng = random.Random(0)
    lines = [
        f"### {ROUTER_NAMES.get(ours, ours)} against each router, request by request",
        "",
        "| load | router | pairs | mean TTFT difference, ours - theirs (ms) [95 % interval] "
        "| ours faster | runs with our mean lower |",
        "|---|---|---|---|---|---|",
    ]
    found = False
    for load, router, runs_pairs in run_pairs(rows, ours):
        diffs = [(a - b) * 1000 for pairs in runs_pairs for a, b in pairs]
        runs = len(runs_pairs)
        lower = sum(
            statistics.fmean(a for a, _ in pairs) < statistics.fmean(b for _, b in pairs)
            for pairs in runs_pairs
        )
        if not diffs:
            continue
        found = True
        n = len(diffs)
        means = sorted(statistics.fmean(rng.choices(diffs, k=n)) for _ in range(1000))
        name = ROUTER_NAMES.get(router, f"vllm-router {router}")
        lines.append(
            f"| {load} | {name} | {n} | {statistics.fmean(diffs):+.1f} "
            f"[{means[25]:+.1f}, {means[974]:+.1f}] "
            f"| {sum(d < 0 for d in diffs) / n:.0%} (equal {sum(d == 0 for d in diffs) / n:.0%}) "
            f"| {lower} of {runs} |"
        )
    return "\n".join(lines) + "\n" if found else ""


def p90_summary(rows: list[dict[str, Any]], ours: str = "kvindex") -> str:
    """The pooled p90 of ``ours`` against every other router's on the same arrivals, with a 95 %
    bootstrap interval: the pairs (one arrival under both routers, every run) are resampled together,
    and the p90 of each side taken again. At light load a run's p90 is one request, so this is the
    comparison that can say whether two routers' tails differ at all."""
    rng = random.Random(0)
    lines = [
        f"### {ROUTER_NAMES.get(ours, ours)} against each router: the pooled p90",
        "",
        "| load | router | pairs | p90 ours / theirs (s) | difference (ms) [95 % interval] |",
        "|---|---|---|---|---|",
    ]
    found = False

    def diff(ps: list[tuple[float, float]]) -> float:
        return (pct(sorted(a for a, _ in ps), 90) - pct(sorted(b for _, b in ps), 90)) * 1000  # type: ignore[operator]

    for load, router, runs_pairs in run_pairs(rows, ours):
        pairs = [p for ps in runs_pairs for p in ps]
        if len(pairs) < 10:
            continue
        found = True
        boot = sorted(diff(rng.choices(pairs, k=len(pairs))) for _ in range(1000))
        ours_p90 = pct(sorted(a for a, _ in pairs), 90)
        theirs_p90 = pct(sorted(b for _, b in pairs), 90)
        name = ROUTER_NAMES.get(router, f"vllm-router {router}")
        lines.append(
            f"| {load} | {name} | {len(pairs)} | {ours_p90:.3f} / {theirs_p90:.3f} | "
            f"{diff(pairs):+.1f} [{boot[25]:+.1f}, {boot[974]:+.1f}] |"
        )
    return "\n".join(lines) + "\n" if found else ""


def pool_results(paths: list[Path]) -> int:
    """The tables over several invocations' results.json together (their runs renumbered apart)."""
    rows: list[dict[str, Any]] = []
    calibration: dict[str, float] = {}
    for i, path in enumerate(paths):
        data = json.loads(path.read_text())
        calibration = calibration or data.get("calibration") or {}
        for r in data["runs"]:
            rows.append({**r, "run": r["run"] + 1000 * i})
    print(f"Pooled: {len(paths)} invocations ({', '.join(str(p) for p in paths)})\n")
    print(summary(rows, {}) + paired_summary(rows) + "\n" + p90_summary(rows))
    return 0


def goodput_summary(rows: list[dict[str, Any]]) -> str:
    """Per load and router: SLO goodput over all arrivals, mean over runs (min-max), and shed."""
    if not rows:
        return ""
    lines = [
        f"### SLO goodput (TTFT objective {rows[0]['slo_s']:.2f} s; a shed or failed request missed it)",
        "",
        "| load | router | goodput | goodput (req/s) | shed | TTFT p90 of served (s) |",
        "|---|---|---|---|---|---|",
    ]
    for load in dict.fromkeys(r["load"] for r in rows):
        sel = [r for r in rows if r["load"] == load]
        for router in dict.fromkeys(r["router"] for r in sel):
            rr = [r for r in sel if r["router"] == router]
            shares = [r["slo_met"] / r["requests"] for r in rr if r["requests"]]
            rates = [r["slo_met"] / r["duration_s"] for r in rr]  # per second of arrivals
            name = ROUTER_NAMES.get(router, f"vllm-router {router}")  # kvindex: with admission
            p90s = [r["ttft_p90"] for r in rr if r["ttft_p90"] is not None]
            lines.append(
                f"| {load} ({rr[0]['rate']} req/s) | {name} | {statistics.fmean(shares):.1%} "
                f"({min(shares):.1%}-{max(shares):.1%}) | {statistics.fmean(rates):.2f} | "
                f"{sum(r['shed'] for r in rr)}/{sum(r['requests'] for r in rr)} | "
                f"{statistics.fmean(p90s) if p90s else float('nan'):.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--vllm-router", type=Path, default=ROOT / ".venv-vllm-router" / "bin" / "vllm-router")
    p.add_argument("--model-dir", type=Path, default=ROOT / "e2e" / "routing-llama")
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out-routing")
    p.add_argument(
        "--routers",
        nargs="+",
        default=[r for r in ROUTERS if r != "kvindex-process"],
        help=f"of {', '.join(ROUTERS)} and variants",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=POLICY.PARAM=VALUE[,...]",
        help="one more kvindex router, NAME, with these `kvindex serve --policy-option`s "
        "(e.g. kvindex-rc0=ttft.replica_cost=0); list NAME in --routers",
    )
    p.add_argument(
        "--loads", nargs="+", default=["light", "high"], choices=("light", "high", "peak", "overload")
    )
    p.add_argument(
        "--light-rate", type=float, default=0.0, help="requests/s at light load (0: 20 %% of no-hit capacity)"
    )
    p.add_argument(
        "--high-rate", type=float, default=0.0, help="req/s at high load (0: 80 %% of no-hit capacity)"
    )
    p.add_argument(
        "--peak-rate", type=float, default=0.0, help="req/s at peak (0: 140 %% of no-hit capacity)"
    )
    p.add_argument(
        "--overload-rate", type=float, default=0.0, help="req/s at overload (0: 600 %% of no-hit capacity)"
    )
    p.add_argument(
        "--slo-ms", type=float, default=0.0, help="TTFT objective of every request (0: 2.5x a 2K prefill)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument(
        "--warmup", type=float, default=40.0, help="seconds of light load calibrating kvindex first (0: none)"
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--cache-blocks", type=int, default=400, help="KV blocks per engine (32 tokens each)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--router-log-level", default="warning", help="vllm-router's (debug shows its picks)")
    p.add_argument(
        "--kvindex-proxy",
        choices=("in-process", "process"),
        default="in-process",
        help="kvindex's OpenAI proxy inside the index (serve --route-port, the default) or as its own "
        "kvindex route process, calling the index over gRPC",
    )
    p.add_argument(
        "--pool-results",
        nargs="+",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: print the tables over these invocations' results.json together",
    )
    args = p.parse_args()
    if args.pool_results:
        return pool_results(args.pool_results)
    for v in args.variant:
        name, eq, opts = v.partition("=")
        if not eq or not name.startswith("kvindex-") or name in ROUTERS or not opts:
            p.error(f"--variant {v!r}: expected kvindex-NAME=POLICY.PARAM=VALUE[,...]")
        VARIANTS[name] = opts.split(",")
        KVINDEX.append(name)
        ROUTER_NAMES[name] = f"kvindex route (ttft, calibrated, {', '.join(VARIANTS[name])})"
    unknown = [r for r in args.routers if r not in ROUTERS and r not in VARIANTS]
    if unknown:
        p.error(f"--routers: unknown {unknown} (choose from {', '.join(ROUTERS)} or a --variant name)")
    for path in (args.vllm_python, args.model_dir / "kvindex-e2e.json"):
        if not path.exists():
            print(f"missing {path}: run `make e2e-routing` (it installs what is needed)", file=sys.stderr)
            return 2
    if any(r != "kvindex" for r in args.routers) and not args.vllm_router.exists():
        print(f"missing {args.vllm_router}: run `make e2e-routing`", file=sys.stderr)
        return 2
    return Bench(args).main()


if __name__ == "__main__":
    raise SystemExit(main())
