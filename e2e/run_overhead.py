"""What a router's processes cost the engines they route to: cold-prompt TTFT, paired.

On a host where CPU engines and the router share cores (the e2e routing set-up: two vLLM CPU engines
pinned one per core of a 2-vCPU VM), every millisecond the router's processes run can come out of a
prefill. This measures it directly, with the same two engines and model as ``e2e/run_routing.py``:

1. start the engines, warm them on cold prompts (their first prompts of a length are slower);
2. start one router (``kvindex`` = serve + a shim per engine + route, or a vllm-router policy);
3. send unique cold prompts (no shared prefix: every one is a full prefill) one at a time, in pairs
   whose order is shuffled: one **direct** to an engine while the router's processes run, one direct
   to the same engine while they are stopped (SIGSTOP: no CPU at all, memory kept); and, for the
   proxy's own path, one **via** the router while they run;
4. report, per condition, the mean and median TTFT and the paired differences (running - stopped,
   via - direct) with a bootstrap interval.

Engine speed drifts by several percent over minutes on a shared VM; pairing prompt by prompt, in
shuffled order and close in time, is what makes a difference of 1-2 % visible.

    .venv/bin/python e2e/run_overhead.py --router kvindex --pairs 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_routing import ROOT, ROUTERS, Bench, Request, send_all, tree_pids


def bootstrap(diffs: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of ``diffs`` (resampled with replacement)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


class Overhead:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bench = Bench(args)
        self.rng = random.Random(args.seed)

    def cold(self) -> list[dict[str, str]]:
        """A prompt no engine has seen: a full prefill wherever it goes."""
        return [{"role": "user", "content": self.bench.words(self.rng, self.args.tokens) + "\nWhy?"}]

    def ttft(self, base: str) -> float:
        (result,) = asyncio.run(send_all(base + "/v1", [Request(0.0, "document", self.cold(), "cold")], 8))
        if result.ttft is None:
            raise RuntimeError(f"request to {base} failed: {result.error}")
        return result.ttft

    def main(self) -> dict[str, Any]:
        a, b = self.args, self.bench
        try:
            b.start_engines()
            engines = [e.base for e in b.engines]
            for _ in range(a.warmup):
                for base in engines:
                    self.ttft(base)
            via, procs = b.start_router(a.router)
            pids = [p for proc in procs for p in tree_pids(proc.popen.pid)]
            if b.nats is not None:
                pids += tree_pids(b.nats.popen.pid)
            time.sleep(a.settle)
            pairs: dict[str, list[tuple[float, float]]] = {"running-stopped": [], "via-direct": []}
            for i in range(a.pairs):
                engine = engines[i % len(engines)]
                # Direct while running, direct while stopped, via the router: in a random order.
                plan = ["running", "stopped", "via"]
                self.rng.shuffle(plan)
                got: dict[str, float] = {}
                for cond in plan:
                    if cond == "stopped":
                        for pid in pids:
                            os.kill(pid, signal.SIGSTOP)
                    try:
                        time.sleep(a.gap)
                        got[cond] = self.ttft(via if cond == "via" else engine)
                    finally:
                        if cond == "stopped":
                            for pid in pids:
                                os.kill(pid, signal.SIGCONT)
                    time.sleep(a.gap)
                pairs["running-stopped"].append((got["running"], got["stopped"]))
                pairs["via-direct"].append((got["via"], got["running"]))
            stages = route_stages(via) if a.router == "kvindex" else {}
            for proc in reversed(procs):
                proc.stop()
        finally:
            for proc in reversed(b.procs):
                proc.stop()
        return self.report(pairs, stages)

    def report(
        self, pairs: dict[str, list[tuple[float, float]]], stages: dict[str, float] | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"router": self.args.router, "tokens": self.args.tokens, "pairs": {}}
        lines = [
            f"router {self.args.router}: {len(pairs['running-stopped'])} pairs of cold "
            f"{self.args.tokens}-token prompts (TTFT in ms)",
            "",
            "| comparison | first: mean / median | second: mean / median | paired difference: mean "
            "[95 % interval] / median | relative |",
            "|---|---|---|---|---|",
        ]
        for name, xs in pairs.items():
            first, second = [x for x, _ in xs], [y for _, y in xs]
            diffs = [(x - y) * 1000 for x, y in xs]
            lo, hi = bootstrap(diffs)
            rel = statistics.fmean(diffs) / (statistics.fmean(second) * 1000)
            out["pairs"][name] = {"first": first, "second": second}
            lines.append(
                f"| {name} | {statistics.fmean(first) * 1000:.1f} / {statistics.median(first) * 1000:.1f} | "
                f"{statistics.fmean(second) * 1000:.1f} / {statistics.median(second) * 1000:.1f} | "
                f"{statistics.fmean(diffs):+.1f} [{lo:+.1f}, {hi:+.1f}] / {statistics.median(diffs):+.1f} | "
                f"{rel:+.1%} |"
            )
        if stages:
            # Where a via request's time went, from the proxy's own clock: what it did before
            # forwarding, the engine's TTFT as the proxy saw it (compare with direct), the relay.
            direct = statistics.fmean(y for _, y in pairs["via-direct"]) * 1000
            out["stages_ms"] = stages
            lines += [
                "",
                "kvindex route's stages on the via requests (means, ms): "
                + ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
                + f"; the engine's TTFT direct while running: {direct:.1f}",
            ]
        out["table"] = "\n".join(lines) + "\n"
        return out


def route_stages(base: str) -> dict[str, float]:
    """Mean milliseconds per stage of ``kvindex route``'s requests, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    from run_vllm import http

    status, body = http(base + "/metrics", timeout=5)
    if status != 200:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name != "kvindex_route_stage_seconds":
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage", "")
            if sample.name.endswith("_sum"):
                sums[stage] = sample.value
            elif sample.name.endswith("_count"):
                counts[stage] = sample.value
    return {k: sums[k] / counts[k] * 1000 for k in sums if counts.get(k)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="kvindex", choices=[r for r in ROUTERS if r != "kvindex-default"])
    p.add_argument("--pairs", type=int, default=24, help="cold prompts per condition")
    p.add_argument("--tokens", type=int, default=1600, help="cold prompt length (tokens)")
    p.add_argument("--warmup", type=int, default=8, help="cold prompts per engine before measuring")
    p.add_argument(
        "--settle", type=float, default=10.0, help="seconds between starting the router and measuring"
    )
    p.add_argument("--gap", type=float, default=0.3, help="seconds before and after each prompt")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--vllm-router", type=Path, default=ROOT / ".venv-vllm-router" / "bin" / "vllm-router")
    p.add_argument("--model-dir", type=Path, default=ROOT / "e2e" / "routing-llama")
    p.add_argument("--out", type=Path, default=ROOT / "e2e" / "out-overhead")
    p.add_argument("--cache-blocks", type=int, default=400)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--router-log-level", default="warning")
    args = p.parse_args()
    # What Bench reads and this measurement does not vary.
    args.routers, args.variant, args.slo_ms = [args.router], [], 0.0
    for path in (args.vllm_python, args.model_dir / "kvindex-e2e.json"):
        if not path.exists():
            print(
                f"missing {path}: run `make e2e-routing` once (it installs what is needed)", file=sys.stderr
            )
            return 2
    result = Overhead(args).main()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"overhead-{args.router}.json").write_text(json.dumps(result, indent=1))
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
