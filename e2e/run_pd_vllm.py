"""Disaggregated prefill/decode on real engines: ``kvindex route --pd`` in front of two vLLM CPU engines
that move KV with NixlConnector (UCX over a CPU buffer).

- engine 0 announces ``--role prefill``, engine 1 ``--role decode`` (``kvshim vllm`` bridges, KV
  events on, the random Llama of ``make e2e-routing``); both run ``--kv-transfer-config
  {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}``;
- ``kvindex serve`` (embedded NATS, the model's tokenizer) and ``kvindex route --pd`` with a low
  ``--pd-min-input-tokens`` (256) so that the chat requests here (about 1,100 tokens) take two steps;
- requests (chat, greedy) go through the proxy: long ones must be served in two steps (header
  ``x-kvindex-pd: remote``), NIXL transfers must show on the decode engine
  (``vllm:nixl_xfer_time_seconds_count``), and each answer must equal the one the prefill engine
  gives for the same request served whole (greedy decoding: the transferred KV is the KV); a short
  one must be prefilled by the decode engine itself.

NIXL is not a dependency of vLLM's CPU build: ``pip install nixl-cu12`` (PyPI; its UCX backend
needs no GPU) into the vLLM environment, or into a directory given with ``--nixl-path`` (put on
the engines' PYTHONPATH). docs/pd.md shows a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_vllm import Proc, free_port, http, wait_log_event

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "routing-llama"
BLOCK = 32


def metric(base: str, name: str) -> float:
    _, body = http(f"{base}/metrics", timeout=5)
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, dict[str, str], bytes, float]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            first = resp.read(1)
            ttfb = time.monotonic() - started
            return resp.status, dict(resp.headers), first + resp.read(), ttfb
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read(), time.monotonic() - started


def wait_roles(grpc_port: int, procs: list[Proc]) -> None:
    """Until the index lists both engines with an endpoint and the role their shim announces."""
    import grpc

    from kvindex.v1 import kvindex_pb2 as pb
    from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

    deadline = time.monotonic() + 90
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = pb_grpc.KvIndexStub(ch)
        while time.monotonic() < deadline:
            try:
                got = stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=2).instances
                if {(i.instance_id, i.role) for i in got if i.endpoint} == {
                    ("vllm0/0", "prefill"),
                    ("vllm1/0", "decode"),
                }:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise RuntimeError("the shims did not announce the engines' roles in time:\n" + procs[-1].tail(20))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--model-dir", type=Path, default=ROOT / "e2e" / "routing-llama")
    p.add_argument("--nixl-path", default="", help="a directory holding the nixl package (PYTHONPATH)")
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out-pd")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--startup-timeout", type=float, default=400.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    bases: list[str] = []
    try:
        for n in (0, 1):
            port, zmq, replay = free_port(), free_port(), free_port()
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq}",
                      "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}  # fmt: skip
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            env = {
                "VLLM_CPU_OMP_THREADS_BIND": str(n), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_LOGGING_LEVEL": "WARNING",
            }  # fmt: skip
            if a.nixl_path:
                env["PYTHONPATH"] = a.nixl_path
            argv = [
                "taskset", "-c", str(n), str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(a.model_dir), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
                "--max-model-len", "4096", "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--num-gpu-blocks-override", "400", "--kv-cache-memory-bytes", str(512 << 20),
                "--max-num-seqs", "8", "--kv-events-config", json.dumps(events),
                "--kv-transfer-config", json.dumps(kv),
            ]  # fmt: skip
            procs.append(Proc(f"vllm{n}", argv, a.out / f"vllm{n}.log", env))
            bases.append(f"http://127.0.0.1:{port}")
            procs[-1].zmq, procs[-1].replay = zmq, replay  # type: ignore[attr-defined]
        deadline = time.monotonic() + a.startup_timeout
        for proc, base in zip(procs, bases, strict=True):
            while True:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail(40)}")
                try:
                    if http(f"{base}/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} not healthy in time:\n{proc.tail(40)}")
                time.sleep(1.0)
        print(f"engines up: {bases}", flush=True)
        grpc_port, route_port = free_port(), free_port()
        serve = Proc(
            "kvindex",
            [str(BIN / "kvindex"), "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
             "--metrics-port", "-1", "--log-format", "json", "--tokenizer", f"{MODEL}={a.model_dir}"],
            a.out / "kvindex.log",
        )  # fmt: skip
        procs.append(serve)
        nats = wait_log_event(serve.log_path, "embedded_nats_started", serve, 30)["url"]
        for n, role in ((0, "prefill"), (1, "decode")):
            eng = procs[n]
            procs.append(
                Proc(
                    f"kvshim{n}",
                    [str(BIN / "kvshim"), "vllm", "--zmq", f"tcp://127.0.0.1:{eng.zmq}",  # type: ignore[attr-defined]
                     "--replay", f"tcp://127.0.0.1:{eng.replay}", "--topic", "kv-events",  # type: ignore[attr-defined]
                     "--metrics-url", f"{bases[n]}/metrics", "--worker-id", f"vllm{n}", "--model", MODEL,
                     "--block-size", str(BLOCK), "--role", role, "--nats", nats, "--log-format", "json"],
                    a.out / f"kvshim{n}.log",
                )
            )  # fmt: skip
        procs.append(
            Proc(
                "route",
                [str(BIN / "kvindex"), "route", "--index", f"127.0.0.1:{grpc_port}", "--host", "127.0.0.1",
                 "--port", str(route_port), "--log-format", "json", "--pd", "--pd-min-input-tokens", "256"],
                a.out / "route.log",
            )
        )  # fmt: skip
        route = f"http://127.0.0.1:{route_port}"
        wait_roles(grpc_port, procs)
        deadline = time.monotonic() + 60
        while True:  # the proxy listens, and has refreshed its instance list (every 2 s) since
            try:
                if http(f"{route}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or not procs[-1].alive():
                raise RuntimeError(f"kvindex route not up:\n{procs[-1].tail(20)}")
            time.sleep(0.3)
        time.sleep(2.5)
        words = " ".join(f"w{i % 97}" for i in range(400))
        xfers0 = metric(bases[1], "vllm:nixl_xfer_time_seconds_count")
        rows = []
        for i in range(a.prompts):
            content = f"document {i}: {words} question {i}?"
            chat = {
                "model": MODEL,
                "max_tokens": 12,
                "temperature": 0.0,
                "messages": [{"role": "user", "content": content}],
            }
            status, headers, body, ttfb = post(f"{route}/v1/chat/completions", chat)
            lower = {k.lower(): v for k, v in headers.items()}
            answer = json.loads(body) if status == 200 else {}
            text = answer.get("choices", [{}])[0].get("message", {}).get("content")
            # The same request served whole by the prefill engine (its prefix cache holds the
            # prompt; greedy decoding gives the same tokens when the transferred KV is right).
            _, _, whole, _ = post(f"{bases[0]}/v1/chat/completions", chat)
            whole_text = json.loads(whole)["choices"][0]["message"]["content"]
            rows.append(
                {
                    "status": status,
                    "pd": lower.get("x-kvindex-pd"),
                    "decode": lower.get("x-kvindex-instance"),
                    "prefill": lower.get("x-kvindex-prefill-instance"),
                    "seconds": round(ttfb, 3),
                    "prompt_tokens": answer.get("usage", {}).get("prompt_tokens"),
                    "same_text": text == whole_text,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        short = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
        status, headers, _, _ = post(f"{route}/v1/chat/completions", short)
        lower = {k.lower(): v for k, v in headers.items()}
        rows.append(
            {"status": status, "pd": lower.get("x-kvindex-pd"), "decode": lower.get("x-kvindex-instance")}
        )
        print(json.dumps(rows[-1]), flush=True)
        xfers = metric(bases[1], "vllm:nixl_xfer_time_seconds_count") - xfers0
        xfer_s = metric(bases[1], "vllm:nixl_xfer_time_seconds_sum")
        summary = {"requests": rows, "nixl_transfers_on_decode": xfers, "nixl_xfer_seconds_sum": xfer_s}
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
        remote = [r for r in rows[:-1] if r["pd"] == "remote"]
        ok = (
            len(remote) == a.prompts
            and all(r["same_text"] and r["prefill"] == "vllm0/0" and r["decode"] == "vllm1/0" for r in remote)
            and xfers >= a.prompts
            and rows[-1]["pd"] == "local;reason=short_input"
        )
        print(f"nixl transfers on the decode engine: {xfers:.0f} ({xfer_s:.3f} s in total)")
        print("PD on real engines:", "OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
