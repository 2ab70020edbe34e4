"""Real engine end to end: an index that knows when it is wrong (docs/feedback.md).

A real vLLM (CPU build) serves through ``kvindex route``; ``kvshim vllm`` reads the engine's KV events
through a fault proxy (a ZMQ SUB -> PUB relay the driver runs) that drops them for a while, silently:
the bridge sees no gap (nothing after the loss reaches it) and the index's digests agree with the
bridge. Only the engine's own answers show the loss: the proxy reads
``usage.prompt_tokens_details.cached_tokens`` from every answer and reports it with the release,
and the index compares it with what it predicted.

Phases (one instance, so every request goes to it; requests as token ids, half of them streamed):

1. ``in sync``: prompts, then the same prompts again once the speculative keys of their commits have
   expired (10 s): every outcome exact;
2. ``events lost``: the relay drops everything; new prompts, then (after the speculative TTL) the
   same prompts again: the engine hits, the index promised nothing (``under``) -> the instance is
   degraded, which asks the bridge for a snapshot; the bridge first takes what the engine's replay
   buffer holds after its last batch, so the snapshot carries the lost blocks;
3. ``repaired``: the relay passes events again; the prompts once more: exact, and the instance exact.

Exit status 0 when: every request answered 200; the instance was degraded within
``--degraded-within`` requests of the first repeat sent while events were lost; it was exact at the
end; every outcome outside the fault phase exact. 1 otherwise, 2 when the venv or the model is
missing. The table goes to ``e2e/out-feedback/table.md`` with every request in ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import zmq

from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_vllm import (
    BIN,
    BLOCK,
    MAX_MODEL_LEN,
    MODEL,
    ROOT,
    Proc,
    free_port,
    http,
    log,
    missing_inputs,
    wait_log_event,
)

WORKER = "vllm-feedback-0"
INSTANCE = f"{WORKER}/0"
SPECULATIVE_TTL = 10.0  # the ttft policy's: a commit's blocks count as present this long


class FaultRelay:
    """Engine PUB -> this SUB -> this PUB -> the bridge; ``dropping`` loses every message."""

    def __init__(self, upstream: str, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.dropping = threading.Event()
        self.passed = 0
        self.dropped = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.sub.recv_multipart()
            if self.dropping.is_set():
                self.dropped += 1
            else:
                self.passed += 1
                self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


@dataclass
class Request:
    n: int
    phase: str
    name: str
    prompt_tokens: int
    stream: bool
    status: int
    outcome: str  # exact / over / under, from the instance's outcome counters (or "none")
    state: str  # the instance's state after the report
    state_reason: str
    usage_in_stream: bool = False  # the client got a usage chunk it did not ask for (must not)
    engine_cached: int | None = None  # non-streamed answers: usage.prompt_tokens_details.cached_tokens


@dataclass
class Timeline:
    """The instance's state as polled every 20 ms (transitions only)."""

    changes: list[tuple[float, str, str]] = field(default_factory=list)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.http_port, self.zmq_port, self.replay_port = free_port(), free_port(), free_port()
        self.relay_port, self.grpc_port, self.route_port = free_port(), free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.route = f"http://127.0.0.1:{self.route_port}"
        self.requests: list[Request] = []
        self.timeline = Timeline()
        self.failures: list[str] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()

    # -- processes -------------------------------------------------------------------------------

    def start(self) -> None:
        a = self.args
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.zmq_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        vllm_argv = [
            str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(a.model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.http_port),
            "--dtype", "float32", "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", str(BLOCK), "--enable-prefix-caching",
            "--num-gpu-blocks-override", "96",  # room for every prompt: no evictions in this run
            "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.3",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        vllm = Proc("vllm", vllm_argv, self.out / "vllm.log", {"VLLM_LOGGING_LEVEL": "INFO"})
        self.procs.append(vllm)
        index_argv = [
            str(BIN / "kvindex"), "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
            "--metrics-port", "-1", "--log-format", "json",
            # The periodic snapshot (every 60 s, first at a random moment) also repairs the loss (it
            # asks the bridge, which asks the engine's replay buffer): off, so that what finds the
            # loss here is the engine's answers.
            "--reconcile-interval", "0",
        ]  # fmt: skip
        index = Proc("kvindex", index_argv, self.out / "kvindex.log")
        self.procs.append(index)
        self.nats_url = wait_log_event(index.log_path, "embedded_nats_started", index, 30)["url"]
        wait_log_event(index.log_path, "kvindex_serving", index, 30)
        self.stub = pb_grpc.KvIndexStub(grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}"))
        deadline = time.monotonic() + a.startup_timeout
        while True:
            if not vllm.alive():
                raise RuntimeError(f"vLLM exited ({vllm.popen.returncode}):\n{vllm.tail(40)}")
            try:
                if http(f"{self.base}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy within {a.startup_timeout:.0f}s:\n{vllm.tail(40)}")
            time.sleep(0.5)
        log(f"vLLM up on :{self.http_port}")
        self.relay = FaultRelay(f"tcp://127.0.0.1:{self.zmq_port}", self.relay_port)
        shim_argv = [
            str(BIN / "kvshim"), "vllm",
            "--zmq", self.relay.endpoint, "--replay", f"tcp://127.0.0.1:{self.replay_port}",
            "--topic", "kv-events", "--metrics-url", f"{self.base}/metrics",
            "--worker-id", WORKER, "--model", MODEL, "--block-size", str(BLOCK),
            "--nats", self.nats_url, "--log-format", "json",
        ]  # fmt: skip
        shim = Proc("kvshim", shim_argv, self.out / "kvshim.log")
        self.procs.append(shim)
        wait_log_event(shim.log_path, "kvshim_started", shim, 30)
        route_argv = [
            str(BIN / "kvindex"), "route", "--index", f"127.0.0.1:{self.grpc_port}",
            "--host", "127.0.0.1", "--port", str(self.route_port),
            "--score-timeout", "2.0", "--refresh-interval", "0.5", "--log-format", "json",
        ]  # fmt: skip
        route = Proc("route", route_argv, self.out / "route.log")
        self.procs.append(route)
        wait_log_event(route.log_path, "route_started", route, 30)
        deadline = time.monotonic() + 30
        while not any(i.endpoint for i in self.instances()):
            if time.monotonic() > deadline:
                raise RuntimeError("the instance never announced its endpoint")
            time.sleep(0.2)
        log(f"kvindex :{self.grpc_port}, kvshim via the relay :{self.relay_port}, route :{self.route_port}")

    def stop(self) -> None:
        self._stop.set()
        for proc in reversed(self.procs):
            proc.stop()
        if hasattr(self, "relay"):
            self.relay.close()

    # -- the index ---------------------------------------------------------------------------------

    def instances(self) -> list[pb.InstanceInfo]:
        return list(self.stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=5).instances)

    def info(self) -> pb.InstanceInfo:
        (info,) = [i for i in self.instances() if i.instance_id == INSTANCE]
        return info

    def watch_state(self) -> None:
        last = ("", "")
        while not self._stop.is_set():
            try:
                info = self.info()
            except (grpc.RpcError, ValueError):
                time.sleep(0.02)
                continue
            now = (info.state, info.state_reason)
            if now != last:
                self.timeline.changes.append((round(time.monotonic() - self.t0, 3), *now))
                last = now
            time.sleep(0.02)

    # -- requests ----------------------------------------------------------------------------------

    def send(self, phase: str, name: str, tokens: list[int], stream: bool) -> Request:
        before = self.info()
        counts = (before.outcomes_exact, before.outcomes_over, before.outcomes_under)
        body: dict[str, Any] = {
            "model": MODEL, "prompt": tokens, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": stream,
        }  # fmt: skip
        status, raw = http(f"{self.route}/v1/completions", body)
        cached = None
        usage_in_stream = False
        if status == 200 and not stream:
            usage = json.loads(raw).get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if stream:
            usage_in_stream = b'"usage"' in raw and b'"usage":null' not in raw.replace(b" ", b"")
        # The report travels with the final release, in the background: wait for its count.
        outcome = "none"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            info = self.info()
            now = (info.outcomes_exact, info.outcomes_over, info.outcomes_under)
            diff = [b - a for a, b in zip(counts, now, strict=True)]
            if any(diff):
                outcome = ("exact", "over", "under")[diff.index(max(diff))]
                break
            time.sleep(0.02)
        info = self.info()
        r = Request(
            len(self.requests) + 1, phase, name, len(tokens), stream, status, outcome,
            info.state, info.state_reason, usage_in_stream, cached,
        )  # fmt: skip
        self.requests.append(r)
        log(
            f"#{r.n:2d} {phase:12s} {name:4s} L={r.prompt_tokens:3d} stream={int(stream)} -> {status} "
            f"{outcome:5s} state={info.state} {info.state_reason}"
        )
        if status != 200:
            self.failures.append(f"request {r.n} ({name}) answered {status}: {raw[:200]!r}")
        if usage_in_stream:
            self.failures.append(f"request {r.n} ({name}): the client got a usage chunk it did not ask for")
        return r

    def prompt(self, seed: int, blocks: int = 4) -> list[int]:
        return [(seed * 7919 + i * 31) % 1000 + 10 for i in range(blocks * BLOCK + 5)]

    def wait_speculation(self) -> None:
        time.sleep(SPECULATIVE_TTL + 1.0)

    def main(self) -> int:
        try:
            self.start()
            threading.Thread(target=self.watch_state, daemon=True).start()
            a_prompts = {f"A{i}": self.prompt(i) for i in range(2)}
            for i, (name, tokens) in enumerate(a_prompts.items()):
                self.send("in sync", name, tokens, stream=bool(i % 2))
            self.wait_speculation()
            for i, (name, tokens) in enumerate(a_prompts.items()):
                self.send("in sync", name, tokens, stream=not i % 2)
            # Events lost from here on.
            self.relay.dropping.set()
            lost_from = self.relay.dropped
            b_prompts = {f"B{i}": self.prompt(10 + i) for i in range(3)}
            for i, (name, tokens) in enumerate(b_prompts.items()):
                self.send("events lost", name, tokens, stream=bool(i % 2))
            self.wait_speculation()
            first_repeat = len(self.requests) + 1
            degraded_at = None
            for i, (name, tokens) in enumerate(b_prompts.items()):
                r = self.send("events lost", name, tokens, stream=not i % 2)
                stats = self.stub.Stats(pb.StatsRequest(), timeout=5)
                if degraded_at is None and stats.snapshots_requested.get("degraded", 0) >= 1:
                    degraded_at = r.n
            dropped = self.relay.dropped - lost_from
            self.relay.dropping.clear()
            # Repaired: the prompts again, and new ones.
            time.sleep(1.0)
            for i, (name, tokens) in enumerate(b_prompts.items()):
                self.send("repaired", name, tokens, stream=bool(i % 2))
            self.send("repaired", "C0", self.prompt(20), stream=True)
            self.wait_speculation()
            self.send("repaired", "C0", self.prompt(20), stream=False)
            final = self.info()
            stats = self.stub.Stats(pb.StatsRequest(), timeout=5)
            self.check(first_repeat, degraded_at, final, dropped)
            self.report(first_repeat, degraded_at, final, stats, dropped)
        finally:
            self.stop()
        return 1 if self.failures else 0

    def check(self, first_repeat: int, degraded_at: int | None, final: pb.InstanceInfo, dropped: int) -> None:
        if dropped == 0:
            self.failures.append("the relay dropped no event while the fault was on")
        if degraded_at is None:
            self.failures.append("the instance never asked for a snapshot as degraded")
        elif degraded_at - first_repeat + 1 > self.args.degraded_within:
            self.failures.append(
                f"degraded only at request {degraded_at}, {degraded_at - first_repeat + 1} requests after "
                f"the first that could show the loss (allowed: {self.args.degraded_within})"
            )
        if not any(state == "degraded" for _, state, _ in self.timeline.changes):
            self.failures.append("the state never showed degraded in ListInstances")
        if final.state != "exact":
            self.failures.append(f"the instance ended {final.state} ({final.state_reason})")
        for r in self.requests:
            if r.phase != "events lost" and r.outcome != "exact":
                self.failures.append(f"request {r.n} ({r.phase} {r.name}): outcome {r.outcome}, not exact")

    def report(
        self, first_repeat: int, degraded_at: int | None, final: pb.InstanceInfo, stats: Any, dropped: int
    ) -> None:
        lines = [
            "| # | phase | prompt | tokens | stream | HTTP | outcome | state after |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.requests:
            state = r.state + (f" ({r.state_reason})" if r.state_reason else "")
            lines.append(
                f"| {r.n} | {r.phase} | {r.name} | {r.prompt_tokens} | {'yes' if r.stream else 'no'} | "
                f"{r.status} | {r.outcome} | {state} |"
            )
        lines += [
            "",
            f"- engine event messages dropped by the relay while the fault was on: {dropped}",
            f"- first request that could show the loss: #{first_repeat}; snapshot asked as degraded after "
            f"request #{degraded_at}",
            "- state timeline (s since start, state, reason): "
            + ", ".join(
                f"{t:.2f} {s}{' (' + why + ')' if why else ''}" for t, s, why in self.timeline.changes
            ),
            f"- outcomes: exact {final.outcomes_exact}, over {final.outcomes_over}, "
            f"under {final.outcomes_under}; snapshots asked: {dict(stats.snapshots_requested)}; "
            "blocks added by snapshots: "
            f"{stats.reconciled_blocks_added}",
            f"- final state: {final.state}",
            f"- result: {'PASS' if not self.failures else 'FAIL: ' + '; '.join(self.failures)}",
        ]
        text = "\n".join(lines)
        print(text)
        (self.out / "table.md").write_text(text + "\n")
        (self.out / "results.json").write_text(
            json.dumps(
                {
                    "requests": [asdict(r) for r in self.requests],
                    "timeline": self.timeline.changes,
                    "dropped": dropped,
                    "failures": self.failures,
                },
                indent=1,
            )
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--model-dir", type=Path, default=ROOT / "e2e" / "tiny-llama")
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out-feedback")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--degraded-within", type=int, default=3, help="requests after the loss can show that must suffice"
    )
    args = p.parse_args()
    if missing_inputs(args):
        return 2
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
