"""Real engine end to end: a real vLLM (CPU build) -> kvshim -> NATS -> kvindex, checked request by request.

Runs in the project's venv (``kvindex`` and ``kvshim`` are the products under test); only vLLM runs in
its own venv (``--vllm-python``). For every request of a scripted workload the driver

1. waits until the events of everything sent before have settled (the engine has been quiet for a
   moment and the index holds as many blocks as the engine's own events say it should);
2. asks the index (gRPC ``Lookup``) how many leading blocks of the prompt the instance holds, and
   predicts the engine's prefix-cache hit with vLLM's rule (:func:`predict_cached`);
3. sends the request (OpenAI completions, prompt as token ids) and reads
   ``usage.prompt_tokens_details.cached_tokens``.

An independent mirror of the engine's cache, built by the driver from the raw ZMQ events with its own
hashing (no project code), tells an index fault (mirror right, index wrong) from an engine whose hits
differ from its own events (both wrong). ``make e2e-vllm`` runs it; docs/e2e-vllm.md explains the method
and shows the measured table. Exit status: 0 when every disagreement is explained, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
import zmq

from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot_results  # beside this script
import tokenize_check

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the project's venv: kvindex and kvshim are its console scripts

MODEL = "tiny-llama"
BLOCK = 32  # vLLM's CPU attention backend accepts multiples of 32 only
POOL_BLOCKS = 24  # as in kvtools/data/vllm_capture: small, so that evictions happen
OUTPUT_TOKENS = 24
MAX_MODEL_LEN = 512
WORKER = "vllm-cpu-0"
INSTANCE = f"{WORKER}/0"

# The load fields of ListInstances and the vLLM series the shim reads them from (docs/bridges.md, Load).
ENGINE_LOAD = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "waiting_prefill_tokens": "num_requests_waiting x request_prompt_tokens sum/count",
    "kv_usage": "kv_cache_usage_perc",
}

# An idle process that wakes every 50 ms and reports how late it woke: the machine's scheduling stalls.
PROBE = """
import json, select, sys, time
stalls, prev = [], time.monotonic()
while not select.select([sys.stdin], [], [], 0.05)[0]:
    now = time.monotonic()
    if now - prev > 0.25:
        stalls.append(round(now - prev - 0.05, 3))
    prev = now
print(json.dumps(stalls))
"""

# Disagreements with these reasons are expected by construction; any other one fails the run.
EXPLAINED = {"shim_down", "reset_deferred"}
REASONS = {
    "shim_down": "sent while the shim was stopped: the index had not yet received the events of the "
    "requests sent since (they arrive by the engine's replay when the shim is back)",
    "reset_deferred": "first request after /reset_prefix_cache: vLLM empties its cache at once but "
    "queues AllBlocksCleared until its next step, so the clear travels in the same batch as this "
    "request's own stores; no event existed when the prediction was made",
    "index_behind_events": "the index differs from the engine's own events (bridge or index fault)",
    "engine_differs_from_events": "the engine's hit differs from what its own KV events announced",
}


def predict_cached(matched_blocks: int, prompt_len: int, block: int = BLOCK) -> int:
    """The prompt tokens vLLM will report as cached, given the blocks the index says the engine holds.

    vLLM (v1 ``KVCacheManager.get_computed_blocks``) looks for a hit of at most ``prompt_len - 1``
    tokens: the last prompt token is always computed, because its logits give the first output token.
    The hit is made of whole cached blocks (``max_length // block_size`` of the prompt's full blocks
    are probed, first miss stops), so a prompt whose every full block is cached still recomputes its
    whole last block when its length is a multiple of the block size.
    """
    return block * min(matched_blocks, (prompt_len - 1) // block)


# -- processes -------------------------------------------------------------------------------------


class Proc:
    """A child process in its own session (vLLM forks an engine core), logging to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log
        self.log = log.open("w")
        self.popen = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM to the process group this child leads, SIGKILL after ``timeout``."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()
        return self.popen.returncode

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_log_event(path: Path, event: str, proc: Proc, timeout: float) -> dict[str, Any]:
    """The first JSON log line of ``path`` whose ``event`` is ``event``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == event:
                    return record
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name}: no {event!r} log line within {timeout:.0f}s:\n{proc.tail()}")


# -- the engine's events, mirrored independently ---------------------------------------------------


class EventMirror:
    """The engine's cached blocks as its KV events announce them, keyed by sha256 over token chains.

    Deliberately independent of the project's decoder, translator and keys: the only shared input is
    the engine's bytes.
    """

    def __init__(self) -> None:
        self.key_of: dict[Any, bytes] = {}  # engine hash -> chained key (kept after eviction: parents)
        self.refs: Counter[Any] = Counter()  # engine hash -> physical copies cached
        self.anomalies: list[str] = []
        self.counts: Counter[str] = Counter()

    @staticmethod
    def chain(parent: bytes | None, tokens: list[int]) -> bytes:
        return hashlib.sha256((parent or b"root") + struct.pack(f"<{len(tokens)}I", *tokens)).digest()

    def prompt_keys(self, tokens: list[int]) -> list[bytes]:
        keys, parent = [], None
        for i in range(len(tokens) // BLOCK):
            parent = self.chain(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
            keys.append(parent)
        return keys

    def held(self) -> set[bytes]:
        return {self.key_of[h] for h, n in self.refs.items() if n > 0}

    def matched(self, tokens: list[int]) -> int:
        held, n = self.held(), 0
        for key in self.prompt_keys(tokens):
            if key not in held:
                break
            n += 1
        return n

    def apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            self.anomalies.append(f"event not a map: {event!r:.80}")
            return
        kind = event.get("type")
        self.counts[str(kind)] += 1
        if kind == "BlockStored":
            if event.get("block_size") != BLOCK or event.get("medium") not in (None, "GPU"):
                self.anomalies.append(f"unexpected store {event!r:.120}")
                return
            hashes, tokens = event["block_hashes"], event["token_ids"]
            parent_hash = event.get("parent_block_hash")
            parent = None if parent_hash is None else self.key_of.get(parent_hash)
            if parent_hash is not None and parent is None:
                self.anomalies.append(f"store with unknown parent {parent_hash!r}")
                return
            if len(tokens) != BLOCK * len(hashes):
                self.anomalies.append(f"store of {len(hashes)} blocks with {len(tokens)} tokens")
                return
            for i, h in enumerate(hashes):
                parent = self.chain(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
                self.key_of[h] = parent
                if self.refs[h] > 0:
                    self.counts["duplicate block stored"] += 1  # a second physical copy of one hash
                self.refs[h] += 1
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                if self.refs[h] <= 0:
                    self.anomalies.append(f"remove of a block not cached {h!r}")
                    continue
                self.refs[h] -= 1
                if self.refs[h] == 0:
                    del self.refs[h]
                else:
                    self.counts["copy removed, block still cached"] += 1
        elif kind == "AllBlocksCleared":
            self.refs.clear()
        else:
            self.anomalies.append(f"unknown event type {kind!r}")


class EngineTap:
    """A second subscriber on vLLM's ZMQ PUB socket: engine sequence numbers, quiet time, the mirror."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.lock = threading.Lock()
        self.mirror = EventMirror()
        self.last_seq = -1
        self.last_time = time.monotonic()
        self.batches = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-tap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            frames = self.sock.recv_multipart()
            with self.lock:
                self.last_time = time.monotonic()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.errors.append(f"unexpected frames {[len(f) for f in frames]}")
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq != self.last_seq + 1:
                    self.errors.append(f"tap saw seq {seq} after {self.last_seq}")
                self.last_seq = seq
                self.batches += 1
                batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
                for event in batch[1]:
                    self.mirror.apply(event)

    def snapshot(self) -> tuple[int, float, int]:
        with self.lock:
            return self.last_seq, self.last_time, len(self.mirror.held())

    def matched(self, tokens: list[int]) -> int:
        with self.lock:
            return self.mirror.matched(tokens)

    def clears(self) -> int:
        with self.lock:
            return self.mirror.counts["AllBlocksCleared"]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()


# -- the engine's HTTP API ---------------------------------------------------------------------------


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def engine_metrics(base: str) -> dict[str, float]:
    """The few vLLM series the comparison needs (engine 0), by name."""
    _, body = http(f"{base}/metrics", timeout=5)
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith("vllm:"):
            continue
        name, labels = m.group(1), m.group(2) or ""
        if name == "vllm:cache_config_info":
            blocks = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if blocks:
                out["num_gpu_blocks"] = float(blocks.group(1))
            continue
        with contextlib.suppress(ValueError):
            out[name.removeprefix("vllm:")] = float(m.group(3))
    return out


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Record:
    n: int
    phase: str
    name: str
    prompt_tokens: int
    index_blocks: int  # leading prompt blocks the index says the instance holds
    events_blocks: int  # the same from the driver's own mirror of the engine's events
    predicted: int  # predict_cached(index_blocks, prompt_tokens)
    engine: int  # usage.prompt_tokens_details.cached_tokens
    settled: bool
    shim_up: bool
    capped: bool = False  # the last-token rule lowered the prediction below index_blocks * BLOCK
    reason: str = ""

    @property
    def agrees(self) -> bool:
        return self.predicted == self.engine


@dataclass
class Sample:
    t: float  # seconds since the load phase began
    values: dict[str, float]


def engine_value(metrics: dict[str, float], field: str) -> float:
    """A ListInstances load field as the shim derives it from vLLM's series (docs/bridges.md, Load)."""
    if field == "waiting_prefill_tokens":  # waiting x mean prompt length
        count = metrics.get("request_prompt_tokens_count", 0.0)
        mean = metrics.get("request_prompt_tokens_sum", 0.0) / count if count else 0.0
        return float(round(metrics.get("num_requests_waiting", 0.0) * mean))
    return metrics.get(ENGINE_LOAD[field], -1.0)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.records: list[Record] = []
        self.shim: Proc | None = None
        self.shim_starts = 0
        self.rng = random.Random(8)
        self.http_port = free_port()
        self.zmq_port = free_port()
        self.replay_port = free_port()
        self.grpc_port = free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.tap: EngineTap | None = None
        self.stub: pb_grpc.KvIndexStub | None = None
        self.engine_samples: list[Sample] = []
        self.index_samples: list[Sample] = []
        self.burst = [0.0, 0.0]
        self.stalls: list[float] = []
        self.notes: list[str] = []
        self.timings: dict[str, float] = {}
        self.reset_pending = False
        self.failures: list[str] = []
        self.sync_seen: dict[str, list[int]] = {}
        self.clears_before_reset = -1
        self.resets = 0
        self.tokenize_results: list[tokenize_check.Result] = []

    # -- starting things ---------------------------------------------------------------------------

    def start_vllm(self) -> None:
        a = self.args
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.zmq_port}",  # vLLM binds only when the host is '*'
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        argv = [
            str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(a.model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.http_port),
            "--dtype", "float32", "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(POOL_BLOCKS),
            "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.3",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        started = time.monotonic()
        vllm = Proc("vllm", argv, self.out / "vllm.log", env)
        self.procs.append(vllm)
        deadline = started + a.startup_timeout
        while time.monotonic() < deadline:
            if not vllm.alive():
                raise RuntimeError(f"vLLM exited ({vllm.popen.returncode}):\n{vllm.tail(40)}")
            with contextlib.suppress(OSError):
                if http(f"{self.base}/health", timeout=2)[0] == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"vLLM not healthy within {a.startup_timeout:.0f}s:\n{vllm.tail(40)}")
        self.timings["vllm_startup_s"] = time.monotonic() - started
        up = self.timings["vllm_startup_s"]
        log(f"vLLM up in {up:.0f}s on :{self.http_port} (events :{self.zmq_port})")

    def start_index(self) -> None:
        argv = [
            str(BIN / "kvindex"), "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
            "--metrics-port", "-1", "--log-format", "json",
            "--tokenizer", f"{MODEL}={self.args.model_dir}",
        ]  # fmt: skip
        proc = Proc("kvindex", argv, self.out / "kvindex.log")
        self.procs.append(proc)
        self.nats_url = wait_log_event(proc.log_path, "embedded_nats_started", proc, 30)["url"]
        wait_log_event(proc.log_path, "kvindex_serving", proc, 30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = pb_grpc.KvIndexStub(self.channel)
        log(f"kvindex serving gRPC :{self.grpc_port}, embedded NATS {self.nats_url}")

    def start_shim(self) -> None:
        self.shim_starts += 1
        argv = [
            str(BIN / "kvshim"), "vllm",
            "--zmq", f"tcp://127.0.0.1:{self.zmq_port}", "--replay", f"tcp://127.0.0.1:{self.replay_port}",
            "--topic", "kv-events", "--metrics-url", f"{self.base}/metrics",
            "--worker-id", WORKER, "--model", MODEL, "--block-size", str(BLOCK),
            "--nats", self.nats_url, "--log-format", "json",
        ]  # fmt: skip
        proc = Proc(f"kvshim#{self.shim_starts}", argv, self.out / f"kvshim-{self.shim_starts}.log")
        self.procs.append(proc)
        self.shim = proc
        wait_log_event(proc.log_path, "kvshim_started", proc, 30)
        log(f"kvshim #{self.shim_starts} started")

    def stop_shim(self) -> None:
        assert self.shim is not None
        code = self.shim.stop()
        log(f"kvshim #{self.shim_starts} stopped (exit {code})")
        self.shim = None

    # -- index and settling ------------------------------------------------------------------------

    def instance(self) -> pb.InstanceInfo | None:
        assert self.stub is not None
        reply = self.stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=5)
        for info in reply.instances:
            if info.instance_id == INSTANCE:
                return info
        return None

    def index_matched(self, tokens: list[int]) -> int:
        assert self.stub is not None
        reply = self.stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=tokens), timeout=5)
        for match in reply.matches:
            if match.instance_id == INSTANCE:
                return match.matched_blocks
        return 0

    def wait_quiet(self, after: float) -> None:
        """Until the engine has published nothing for ``--quiet`` s, counted from ``after`` at least."""
        assert self.tap is not None
        while True:
            _, last, _ = self.tap.snapshot()
            if time.monotonic() >= max(after, last) + self.args.quiet:
                return
            time.sleep(0.02)

    def settle(self, after: float, epoch_not: int | None = None) -> bool:
        """Engine quiet for ``--quiet`` s since ``after`` and its last batch; then the index holding as
        many blocks as the engine's events say, unchanged for ``--stable`` s. False on timeout."""
        a = self.args
        assert self.tap is not None
        deadline = time.monotonic() + a.settle_timeout
        self.wait_quiet(after)
        seen, since = None, time.monotonic()
        while time.monotonic() < deadline:
            info = self.instance()
            _, _, want = self.tap.snapshot()
            state = None if info is None else (info.epoch, info.last_seq, info.blocks.gpu)
            if state != seen:
                seen, since = state, time.monotonic()
            new_epoch = epoch_not is None or (info is not None and info.epoch != epoch_not)
            ok = info is not None and info.blocks.gpu == want and new_epoch
            if ok and time.monotonic() - since >= a.stable:
                assert info is not None
                if info.sync != "synced":  # a repair in progress, or a stale label (see the docs)
                    self.sync_seen.setdefault(info.sync, []).append(len(self.records) + 1)
                return True
            time.sleep(0.05)
        info = self.instance()
        self.failures.append(
            f"settle timed out before request #{len(self.records) + 1}: index "
            f"{None if info is None else info.blocks.gpu} blocks, events {self.tap.snapshot()[2]}"
        )
        return False

    # -- requests ----------------------------------------------------------------------------------

    def complete(self, tokens: list[int], max_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
        body = {
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, data = http(f"{self.base}/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {data[:300]!r}")
        return json.loads(data)

    def ask(self, phase: str, name: str, tokens: list[int]) -> list[int]:
        """Predict, send, compare; returns the generated token ids."""
        assert self.tap is not None
        shim_up = self.shim is not None
        settled = self.settle(time.monotonic()) if shim_up else False
        index_blocks = self.index_matched(tokens)
        events_blocks = self.tap.matched(tokens)
        clears = self.tap.clears()
        reply = self.complete(tokens)
        self.wait_quiet(time.monotonic())
        cleared_by_this_step = self.tap.clears() > clears
        usage = reply["usage"]
        engine = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        assert usage["prompt_tokens"] == len(tokens), usage
        predicted = predict_cached(index_blocks, len(tokens))
        rec = Record(
            n=len(self.records) + 1,
            phase=phase,
            name=name,
            prompt_tokens=len(tokens),
            index_blocks=index_blocks,
            events_blocks=events_blocks,
            predicted=predicted,
            engine=engine,
            settled=settled,
            shim_up=shim_up,
            capped=predicted < index_blocks * BLOCK,
        )
        events_right = predict_cached(events_blocks, len(tokens)) == engine
        if self.reset_pending and cleared_by_this_step:
            self.reset_pending = False
        if not rec.agrees:
            if cleared_by_this_step and engine == 0 and clears == self.clears_before_reset:
                rec.reason = "reset_deferred"
            elif not shim_up and events_right:
                rec.reason = "shim_down"
            elif events_right:
                rec.reason = "index_behind_events"
            else:
                rec.reason = "engine_differs_from_events"
        self.records.append(rec)
        mark = "ok " if rec.agrees else ("exp" if rec.reason in EXPLAINED else "BAD")
        log(
            f"{mark} #{rec.n:<3} {phase:<14} {name:<18} L={len(tokens):<4} index={index_blocks} "
            f"events={events_blocks} predicted={predicted:<4} engine={engine:<4}"
            + (" (last-token rule)" if rec.capped else "")
            + (f" [{rec.reason}]" if rec.reason else "")
        )
        return reply["choices"][0]["token_ids"]

    # -- the workload ------------------------------------------------------------------------------

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 1024) for _ in range(n)]

    def workload(self) -> None:
        sys1 = list(range(100, 164))  # a 2-block system prompt (as in the captures)
        sys2 = self.tokens(3 * BLOCK)  # a 3-block one
        tail = {b: list(range(b, b + 40)) for b in (200, 300, 400)}

        # Shared system prefixes with different tails.
        for b in (200, 300, 400):
            self.ask("shared-prefix", f"sys1+t{b}", sys1 + tail[b])
        sys2_tails = {name: self.tokens(n) for name, n in (("a", 40), ("b", 40), ("c", 10))}
        for name, t in sys2_tails.items():
            self.ask("shared-prefix", f"sys2+{name}", sys2 + t)

        # Exact repeats, and the last-token rule at block boundaries.
        self.ask("repeat", "sys1+t200", sys1 + tail[200])
        x96, x32 = self.tokens(96), self.tokens(32)
        self.ask("repeat", "x96", x96)
        self.ask("repeat", "x96", x96)  # 3 blocks held, 2 reused: the last block is recomputed
        self.ask("repeat", "x32", x32)
        self.ask("repeat", "x32", x32)  # 1 block held, none reused
        self.ask("repeat", "x32+1", [*x32, 7])  # one more token: the block is reused

        # Multi-turn growth: each turn is the previous prompt, the engine's answer and a new message,
        # so later turns hit blocks that hold generated tokens.
        conv = sys1 + self.tokens(30)
        turns: list[list[int]] = []
        for turn in range(1, 5):
            out = self.ask("multi-turn", f"conv turn {turn}", conv)
            turns.append(conv)
            conv = conv + out + self.tokens(30)

        # Unrelated prompts, more than the pool holds: evictions; then re-ask older prompts.
        fillers = [self.tokens(100) for _ in range(8)]
        for i, f in enumerate(fillers):
            self.ask("evictions", f"filler{i}", f)
        self.ask("evictions", "sys1+t300", sys1 + tail[300])
        self.ask("evictions", "conv turn 4", turns[3])
        for i in (0, 3, 6, 7):
            self.ask("evictions", f"filler{i}", fillers[i])

        # The shim restarted mid-run: requests sent while it is down change the engine's cache
        # (stores and evictions); the new shim must learn all of it from the engine's replay.
        self.stop_shim()
        down = [self.tokens(100) for _ in range(3)]
        self.ask("shim-down", "down0", down[0])
        self.ask("shim-down", "down0", down[0])  # the index cannot know yet: explained
        self.ask("shim-down", "down1", down[1])
        self.ask("shim-down", "down2", down[2])
        info = self.instance()
        old_epoch = info.epoch if info is not None else None
        self.start_shim()
        self.settle(time.monotonic(), epoch_not=old_epoch)
        for i in range(3):
            self.ask("after-restart", f"down{i}", down[i])
        for i in (5, 6, 7):
            self.ask("after-restart", f"filler{i}", fillers[i])

        # Prefix-cache reset (dev mode endpoint): AllBlocksCleared, which vLLM only publishes with its
        # next step's events, i.e. together with the next request's (explained disagreement).
        self.reset_cache()
        self.ask("after-reset", "down2", down[2])
        self.ask("after-reset", "down2", down[2])
        self.ask("after-reset", "sys1+t400", sys1 + tail[400])
        self.ask("after-reset", "sys1+t200", sys1 + tail[200])
        # The same, with the mitigation: whoever resets sends any request right after it (here one
        # token, no full block, not counted) so that the clear is published before real traffic.
        self.reset_cache()
        self.complete([5], max_tokens=1)
        self.ask("reset+flush", "sys1+t200", sys1 + tail[200])
        self.ask("reset+flush", "sys1+t200", sys1 + tail[200])

    def reset_cache(self) -> None:
        assert self.tap is not None
        self.settle(time.monotonic())
        self.clears_before_reset = self.tap.clears()
        status, body = http(f"{self.base}/reset_prefix_cache", {})
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache failed ({status}): {body[:200]!r}")
        self.reset_pending = True
        self.resets += 1
        log("prefix cache reset")

    # -- load: what the index shows vs the engine's own metrics -------------------------------------

    def load_phase(self) -> None:
        """Concurrent requests (more than the pool can run at once); both sides sampled meanwhile, each
        by its own thread (the engine's /metrics every 0.05 s, ListInstances every 0.1 s)."""
        a = self.args
        self.settle(time.monotonic())
        prompts = [self.tokens(a.load_prompt_tokens) for _ in range(a.load_requests)]
        results: list[dict[str, Any]] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def engine_sampler() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    before = time.monotonic()
                    values = engine_metrics(self.base)
                    mid = (before + time.monotonic()) / 2 - t0
                    self.engine_samples.append(Sample(mid, {f: engine_value(values, f) for f in ENGINE_LOAD}))
                time.sleep(0.05)

        def index_sampler() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    info = self.instance()
                    if info is not None:
                        values = {f: float(getattr(info.load, f)) for f in ENGINE_LOAD}
                        values["status_age_s"] = info.load.status_age_s
                        self.index_samples.append(Sample(time.monotonic() - t0, values))
                time.sleep(0.1)

        def send(tokens: list[int]) -> None:
            results.append(self.complete(tokens, max_tokens=a.load_output_tokens))

        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        samplers = [threading.Thread(target=f, daemon=True) for f in (engine_sampler, index_sampler)]
        for t in samplers:
            t.start()
        time.sleep(2.0)  # at rest before
        self.burst = [time.monotonic() - t0, 0.0]
        workers = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.burst[1] = time.monotonic() - t0
        time.sleep(3.0)  # at rest after: the idle state reaches the index too
        stop.set()
        for t in samplers:
            t.join()
        self.stalls = json.loads(probe.communicate("", timeout=10)[0] or "[]")
        log(
            f"load phase: {len(results)} concurrent requests in {self.burst[1] - self.burst[0]:.1f} s; "
            f"{len(self.engine_samples)} engine and {len(self.index_samples)} index readings"
        )
        # Settled again: the last concurrent prompts are predicted like any other request.
        for i in (len(prompts) - 1, 0):
            self.ask("after-load", f"load{i}", prompts[i])

    # -- tokenization: kvindex's ids for text and chats vs the engine's (docs/tokenize.md) -------------

    def tokenize_phase(self) -> None:
        """Last, because its requests change the engine's cache: each case's ids from kvindex (Lookup),
        vLLM's /tokenize, the engine's own prompt_token_ids and usage.prompt_tokens."""
        assert self.stub is not None
        if self.tap is not None:
            self.settle(time.monotonic())
        local = Tokenizers.from_dirs({MODEL: str(self.args.model_dir)})
        self.tokenize_results = tokenize_check.check(
            lambda url, body: http(url, body), self.base, self.stub, MODEL, local
        )
        bad = [r for r in self.tokenize_results if not r.agrees]
        for r in bad:
            self.failures.append(f"tokenization differs: {r.name}: {r.detail}")
        n = len(self.tokenize_results)
        log(f"tokenization: {n - len(bad)}/{n} requests agree")

    # -- the report --------------------------------------------------------------------------------

    def load_table(self) -> tuple[list[str], dict[str, Any]]:
        """What ListInstances showed against what the engine's /metrics said.

        For each index reading, the engine reading it reflects is the latest one (not after it) with
        the same values: the reading's *lag* is the time between the two. The load of a heartbeat is
        the shim's last scrape, so the lag is up to one scrape interval (1 s) plus the scrape's own
        duration plus the heartbeat interval (0.5 s). Readings the engine sampler never saw the values
        of (it reads /metrics on a saturated machine too) are counted apart.
        """
        self.settle(time.monotonic())
        eng, idx = self.engine_samples, self.index_samples
        begin, end = self.burst
        during = [s for s in idx if begin <= s.t <= end + 2.0]
        lags: list[float] = []
        unseen = 0
        for s in during:
            te = None
            for e in eng:
                if e.t > s.t:
                    break
                if all(
                    abs(e.values[f] - s.values[f]) <= (1.0 if f == "waiting_prefill_tokens" else 1e-6)
                    for f in ENGINE_LOAD
                ):
                    te = e.t
            if te is None:
                unseen += 1
            else:
                lags.append(s.t - te)
        lags.sort()
        info = self.instance()
        metrics = engine_metrics(self.base)
        assert self.tap is not None

        def peak(samples: list[Sample], f: str) -> float:
            return max((x.values[f] for x in samples if begin <= x.t <= end + 2.0), default=0.0)

        def at_rest(samples: list[Sample]) -> str:
            last = samples[-1].values if samples else {}
            return ", ".join(f"{last.get(f, -1):g}" for f in ENGINE_LOAD)

        lines = [
            "| quantity | index (ListInstances) | engine |",
            "|---|---|---|",
            f"| capacity, blocks | {info.capacity.gpu if info else '-'} | "
            f"{int(metrics.get('num_gpu_blocks', -1))} (`vllm:cache_config_info` num_gpu_blocks) |",
            f"| blocks held at the end | {info.blocks.gpu if info else '-'} | "
            f"{self.tap.snapshot()[2]} (from its KV events; vLLM exports no such gauge) |",
        ]
        for f, series in ENGINE_LOAD.items():
            lines.append(
                f"| {f}: peak during the burst | {peak(idx, f):g} | {peak(eng, f):g} (`vllm:{series}`) |"
            )
        lines.append(
            f"| at rest after the burst ({', '.join(ENGINE_LOAD)}) | {at_rest(idx)} | {at_rest(eng)} |"
        )
        if lags:
            lines.append(
                f"| readings during the burst equal to an earlier engine reading | {len(lags)}/{len(during)} "
                f"({unseen} with values the engine sampler missed) | |"
            )
            lines.append(
                f"| lag of those readings: median, 90th percentile, max | "
                f"{lags[len(lags) // 2]:.2f} s, {lags[int(len(lags) * 0.9)]:.2f} s, {lags[-1]:.2f} s | |"
            )
        ages = [s.values["status_age_s"] for s in during]
        if ages:
            lines.append(f"| heartbeat age when read, max | {max(ages):.2f} s | |")
        lines.append(
            f"| stalls of an idle probe process (wakes every 50 ms) during the load phase | "
            f"{len(self.stalls)}, longest {max(self.stalls, default=0):.2f} s, total "
            f"{sum(self.stalls):.2f} s | |"
        )
        summary = {
            "burst_s": [begin, end],
            "readings_during_burst": len(during),
            "matched": len(lags),
            "unseen": unseen,
            "lag_s": lags,
            "probe_stalls_s": self.stalls,
            "capacity": info.capacity.gpu if info else None,
            "engine_blocks": metrics.get("num_gpu_blocks"),
        }
        rest_idx, rest_eng = at_rest(idx), at_rest(eng)
        if rest_idx != rest_eng:
            self.failures.append(f"load at rest differs: index {rest_idx}, engine {rest_eng}")
        return lines, summary

    def report(self, elapsed: float) -> int:
        recs = self.records
        agree = [r for r in recs if r.agrees]
        bad = [r for r in recs if not r.agrees]
        unexplained = [r for r in bad if r.reason not in EXPLAINED]
        settled = [r for r in recs if r.shim_up]
        down = [r for r in recs if not r.shim_up]
        metrics = engine_metrics(self.base)
        assert self.tap is not None
        lines = [
            f"# Real vLLM end to end: {len(recs)} requests, {len(agree)} exact agreements, "
            f"{len(bad)} disagreements ({len(unexplained)} unexplained)",
            "",
            "| | requests | exact agreements | disagreements |",
            "|---|---|---|---|",
            f"| settled (shim running) | {len(settled)} | {sum(r.agrees for r in settled)} | "
            f"{sum(not r.agrees for r in settled)} |",
            f"| sent while the shim was stopped | {len(down)} | {sum(r.agrees for r in down)} | "
            f"{sum(not r.agrees for r in down)} |",
            f"| **all** | **{len(recs)}** | **{len(agree)}** | **{len(bad)}** |",
            "",
            f"- with a nonzero hit: {sum(r.engine > 0 for r in recs)}; predicted lower than "
            f"blocks held x {BLOCK} by the last-token rule: {sum(r.capped for r in recs)} "
            f"(all {'agreeing' if all(r.agrees for r in recs if r.capped) else 'NOT agreeing'})",
            f"- cached tokens: predicted {sum(r.predicted for r in recs)}, reported "
            f"{sum(r.engine for r in recs)}; engine `vllm:prefix_cache_hits_total` "
            f"{metrics.get('prefix_cache_hits_total', -1):g} of "
            f"{metrics.get('prefix_cache_queries_total', -1):g} queried (load phase included)",
            f"- engine events seen: {dict(self.tap.mirror.counts)} in {self.tap.batches} batches; "
            f"shim restarts: {self.shim_starts - 1}; prefix-cache resets: {self.resets}",
        ]
        if bad:
            lines += ["", "Disagreements:", ""]
            lines += [
                "| # | phase | prompt | L | index blocks | events blocks | predicted | engine | reason |",
                "|---" * 9 + "|",
            ]
            for r in bad:
                lines.append(
                    f"| {r.n} | {r.phase} | {r.name} | {r.prompt_tokens} | {r.index_blocks} | "
                    f"{r.events_blocks} | {r.predicted} | {r.engine} | {r.reason}: {REASONS[r.reason]} |"
                )
        lines += ["", "Per request:", ""]
        lines += ["| # | phase | prompt | L | index blocks | predicted | engine | |", "|---" * 8 + "|"]
        for r in recs:
            flag = "=" if r.agrees else r.reason
            if r.capped:
                flag += " (last-token rule)"
            lines.append(
                f"| {r.n} | {r.phase} | {r.name} | {r.prompt_tokens} | {r.index_blocks} | "
                f"{r.predicted} | {r.engine} | {flag} |"
            )
        load_lines, load_summary = self.load_table()
        lines += ["", "Load, index vs engine (a burst of concurrent requests):", "", *load_lines]
        if self.tokenize_results:
            lines += ["", *tokenize_check.table(self.tokenize_results)]
        anomalies = self.tap.mirror.anomalies + self.tap.errors + self.failures
        for sync, seen in self.sync_seen.items():
            self.notes.append(
                f"ListInstances said sync={sync!r} while the instance's blocks equalled the engine's "
                f"(before requests {seen[0]}..{seen[-1]}, {len(seen)} times)"
            )
        if anomalies or self.notes:
            lines += ["", "Notes:", *(f"- {x}" for x in anomalies + self.notes)]
        startup = self.timings.get("vllm_startup_s", 0)
        lines += ["", f"Wall time {elapsed:.0f} s (vLLM start-up {startup:.0f} s)."]
        text = "\n".join(lines)
        print("\n" + text)
        (self.out / "table.md").write_text(text + "\n")
        (self.out / "results.json").write_text(
            json.dumps(
                {
                    "records": [asdict(r) for r in recs],
                    "load": load_summary,
                    "engine_samples": [asdict(s) for s in self.engine_samples],
                    "index_samples": [asdict(s) for s in self.index_samples],
                    "notes": self.notes,
                    "tokenize": [asdict(r) for r in self.tokenize_results],
                    "anomalies": anomalies,
                    "timings": self.timings,
                },
                indent=1,
            )
        )
        for png in plot_results.write_plots(self.out / "results.json"):  # predicted vs reported cached tokens
            log(f"plot: {png}")
        if unexplained or anomalies:
            log(f"FAILED: {len(unexplained)} unexplained disagreements, {len(anomalies)} other failures")
            return 1
        return 0

    def main(self) -> int:
        started = time.monotonic()
        try:
            self.start_vllm()
            if self.args.tokenize_only:  # a quick check of the tokenization phase alone
                self.start_index()
                self.tokenize_phase()
                print("\n".join(tokenize_check.table(self.tokenize_results)))
                return 1 if self.failures else 0
            self.tap = EngineTap(f"tcp://127.0.0.1:{self.zmq_port}")
            self.start_index()
            self.start_shim()
            self.workload()
            self.load_phase()
            self.tokenize_phase()
            return self.report(time.monotonic() - started)
        finally:
            if self.tap is not None:
                self.tap.close()
            for proc in reversed(self.procs):
                proc.stop()
            log(f"logs in {self.out}")


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def missing_inputs(args: argparse.Namespace) -> bool:
    """Whether the vLLM venv or the model (made by `make e2e-vllm`) is missing; says which."""
    for path, what in ((args.vllm_python, "the vLLM venv"), (args.model_dir / "config.json", "the model")):
        if not path.exists():
            print(f"{path} missing: {what} is created by `make e2e-vllm`", file=sys.stderr)
            return True
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--model-dir", type=Path, default=ROOT / "e2e" / "tiny-llama")
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for vLLM to become healthy")
    p.add_argument("--quiet", type=float, default=0.3, help="engine silent this long after a request (s)")
    p.add_argument("--stable", type=float, default=0.3, help="index unchanged this long (s)")
    p.add_argument("--settle-timeout", type=float, default=15.0)
    p.add_argument("--load-requests", type=int, default=16, help="concurrent requests of the load burst")
    p.add_argument("--load-prompt-tokens", type=int, default=64)
    p.add_argument("--load-output-tokens", type=int, default=440)
    p.add_argument("--tokenize-only", action="store_true", help="only the tokenization comparison")
    args = p.parse_args()
    if missing_inputs(args):
        return 2
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
