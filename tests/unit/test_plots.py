"""PNG plots of routing results (kvtools/plots.py): what the real-engine runs draw from their
results.json (e2e/plot_results.py) on a small synthetic one of each kind, and the routing
simulation's load and prediction plots (benchmarks/routing_sim.py) from synthetic run results."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvtools.plots import LoadPoint

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module's annotations through it
    spec.loader.exec_module(module)
    return module


plot_results = load("e2e_plot_results", ROOT / "e2e" / "plot_results.py")


def is_small_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size < 150_000


def routing_results() -> dict:
    """run_routing.py's shape: runs of (router, load), each with its requests' TTFT and estimate."""
    rng = random.Random(1)
    runs = []
    for run in range(2):
        for load, scale in (("light", 1.0), ("high", 3.0)):
            for router in ("kvindex", "round_robin"):
                results = []
                for i in range(20):
                    ttft = None if i == 0 and load == "high" else scale * (0.1 + 0.01 * i)  # one failed
                    est = ttft * rng.uniform(0.7, 1.4) if router == "kvindex" and ttft else None
                    results.append({"at": i, "kind": "chat", "ttft": ttft, "total": None, "est_ttft": est})
                met = sum(1 for r in results if r["ttft"] is not None and r["ttft"] <= 0.5)
                runs.append(
                    {"router": router, "load": load, "run": run, "requests": 20, "slo_met": met, "slo_s": 0.5,
                     "results": results}
                )  # fmt: skip
    return {"calibration": {}, "warmup": None, "runs": runs}


def test_routing_points_pool_every_run_of_a_router_at_a_load() -> None:
    points = {(p.policy, p.load): p for p in plot_results.routing_points(routing_results())}
    assert set(points) == {
        (r, load) for r in ("kvindex", "vllm-router round_robin") for load in ("light", "high")
    }
    light = points[("kvindex", "light")]
    # 40 served TTFTs 0.10 .. 0.29 (each twice): nearest-rank p50 is the 20th, p90 the 36th
    assert light.ttft_p50 == pytest.approx(0.19) and light.ttft_p90 == pytest.approx(0.27)
    assert light.goodput == 1.0  # every TTFT within the 0.5 s objective
    high = points[("kvindex", "high")]
    # at x3: 0.33 .. 0.87 served (0.30 failed): within 0.5 s are 0.33 .. 0.48, 6 of 20 per run
    assert high.goodput == pytest.approx(12 / 40)
    pairs = plot_results.routing_predictions(routing_results())
    assert set(pairs) == {"kvindex, light", "kvindex, high"}
    assert len(pairs["kvindex, light"]) == 40 and len(pairs["kvindex, high"]) == 38


def test_real_engine_runs_write_their_plots(tmp_path: Path) -> None:
    path = tmp_path / "out-routing" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(routing_results()))
    files = plot_results.write_plots(path)
    assert [f.name for f in files] == ["routing_load.png", "routing_predicted.png"]
    assert all(f.parent == path.parent and is_small_png(f) for f in files)

    records = [
        {"phase": phase, "predicted": p, "engine": e}
        for phase, p, e in [("shared", 32, 32), ("shared", 64, 64), ("evict", 64, 32), ("reset", 0, 0)]
    ]
    vllm = tmp_path / "out" / "results.json"
    vllm.parent.mkdir()
    vllm.write_text(json.dumps({"records": records, "load": {}}))
    assert plot_results.vllm_predictions(json.loads(vllm.read_text())) == {
        "shared": [(32.0, 32.0), (64.0, 64.0)], "evict": [(64.0, 32.0)], "reset": [(0.0, 0.0)]
    }  # fmt: skip
    (png,) = plot_results.write_plots(vllm, tmp_path / "img")
    assert png == tmp_path / "img" / "vllm_predicted.png" and is_small_png(png)
    # A hybrid model's run (--arch): kvindex's predictions and the full-attention group alone's.
    for r, full in zip(records, (32, 64, 64, 96), strict=True):
        r["full_only"] = full
    hybrid = tmp_path / "out-hybrid-gemma3" / "results.json"
    hybrid.parent.mkdir()
    hybrid.write_text(json.dumps({"arch": "gemma3", "records": records, "hybrid": {}}))
    assert plot_results.vllm_predictions(json.loads(hybrid.read_text())) == {
        "kvindex (every KV-cache group)": [(32.0, 32.0), (64.0, 64.0), (64.0, 32.0), (0.0, 0.0)],
        "full-attention group alone": [(32.0, 32.0), (64.0, 64.0), (64.0, 32.0), (96.0, 0.0)],
    }
    (png,) = plot_results.write_plots(hybrid)
    assert is_small_png(png)
    with pytest.raises(ValueError, match="neither"):
        (tmp_path / "other.json").write_text("{}")
        plot_results.write_plots(tmp_path / "other.json")


def test_routing_simulation_plots_load_curves_and_its_estimates(tmp_path: Path) -> None:
    sim = load("routing_sim", ROOT / "benchmarks" / "routing_sim.py")

    def run(policy: str, label: str, scale: float) -> object:
        ttft = {"mean": scale, "p50": scale, "p90": 2 * scale, "p99": 3 * scale}
        estimates = [(0.1 * i * scale, 0.12 * i * scale) for i in range(1, 50)] if policy == "ttft" else []
        return sim.RunResult(
            policy=policy, label=label, requests=100, ttft=ttft, goodput=0.9, hit_rate=0.5, prefill_gpu_s=1.0,
            load_ratio=1.0, max_replicas=1, repairs={}, wall_s=1.0, arrivals=100, slo_met=int(90 / scale),
            predicted=estimates,
        )  # fmt: skip

    results = [
        run(p, label, scale)
        for label, scale in (("x1.0", 1.0), ("x2.6", 2.6))
        for p in ("ttft", "round_robin")
    ]
    files = sim.plot_load_and_predictions("demo", results, tmp_path)
    assert [f.name for f in files] == ["demo_load.png", "demo_predicted.png"]
    assert all(is_small_png(f) for f in files)


def test_load_point_is_what_both_sides_draw() -> None:
    p = LoadPoint("ttft", "x1.0", 0.5, 1.0, 0.9)
    assert (p.policy, p.load, p.ttft_p50, p.ttft_p90, p.goodput) == ("ttft", "x1.0", 0.5, 1.0, 0.9)
