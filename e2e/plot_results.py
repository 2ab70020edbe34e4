"""PNG plots of a real-engine run from its results.json (kvtools/plots.py draws them; matplotlib):

- ``make e2e-routing`` (run_routing.py): ``routing_load.png``, TTFT p50/p90 and SLO goodput against
  load per router (every run of a router at a load pooled), and ``routing_predicted.png``, the TTFT
  kvindex estimated (its ``x-kvindex-est-ttft-ms`` header) against the TTFT measured at the client;
- ``make e2e-vllm`` and ``make e2e-hybrid`` (run_vllm.py): ``vllm_predicted.png``, the cached tokens
  the index predicted against those vLLM reported, per request (hybrid models: and what the
  full-attention group alone would have predicted).

Both drivers call ``write_plots`` after writing results.json; to redraw a run's:

    .venv/bin/python e2e/plot_results.py e2e/out-routing/results.json [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from kvtools.plots import LoadPoint, load_curves, predicted_vs_actual


def router_name(router: str) -> str:
    return router if router.startswith("kvindex") else f"vllm-router {router}"


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``, sorted or not."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def routing_points(data: dict[str, Any]) -> list[LoadPoint]:
    """Per router and load, over every run: TTFT p50 and p90 of the requests served, and goodput
    (within the objective) over every request sent."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in data["runs"]:
        groups.setdefault((row["load"], row["router"]), []).append(row)
    points = []
    for (load, router), rows in groups.items():
        ttfts = [r["ttft"] for row in rows for r in row["results"] if r["ttft"] is not None]
        if not ttfts:
            continue
        sent = sum(row["requests"] for row in rows)
        met = sum(row["slo_met"] for row in rows)
        points.append(LoadPoint(router_name(router), load, pct(ttfts, 50), pct(ttfts, 90), met / sent))
    return points


def routing_predictions(data: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per kvindex router and load: (estimated, measured) TTFT in seconds of every request served."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in data["runs"]:
        pairs = [
            (r["est_ttft"], r["ttft"])
            for r in row["results"]
            if r.get("est_ttft") is not None and r["ttft"] is not None
        ]
        if pairs:
            out.setdefault(f"{router_name(row['router'])}, {row['load']}", []).extend(pairs)
    return out


def vllm_predictions(data: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """(predicted, engine-reported) cached tokens of every checked request, per phase; for a hybrid
    model (``--arch``) kvindex's against what an index of the full-attention group alone would have
    predicted instead."""
    recs = data["records"]
    if data.get("arch", "llama") != "llama":
        return {
            "kvindex (every KV-cache group)": [(float(r["predicted"]), float(r["engine"])) for r in recs],
            "full-attention group alone": [(float(r["full_only"]), float(r["engine"])) for r in recs],
        }
    out: dict[str, list[tuple[float, float]]] = {}
    for r in recs:
        out.setdefault(r["phase"], []).append((float(r["predicted"]), float(r["engine"])))
    return out


def write_plots(results: Path, out: Path | None = None) -> list[Path]:
    """Every plot of ``results`` (a run_routing or run_vllm results.json) into ``out`` (default: beside
    it); [] with a note when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plots]'): no plots", file=sys.stderr)
        return []
    data = json.loads(results.read_text())
    out = out or results.parent
    files: list[Path] = []
    if "runs" in data:
        points = routing_points(data)
        slo = statistics.fmean(row["slo_s"] for row in data["runs"]) if data["runs"] else None
        if points:
            files.append(load_curves(points, out / "routing_load.png", "real engines: TTFT and goodput", slo))
        pairs = routing_predictions(data)
        if pairs:
            title = "real engines: kvindex's TTFT estimate vs measured"
            files.append(predicted_vs_actual(pairs, out / "routing_predicted.png", title))
    elif "records" in data:
        arch = data.get("arch", "llama")
        title = "vLLM: predicted vs reported cached tokens" + ("" if arch == "llama" else f" ({arch})")
        pairs = vllm_predictions(data)
        files.append(
            predicted_vs_actual(pairs, out / "vllm_predicted.png", title, "tokens", log=False, band=None)
        )
    else:
        raise ValueError(f"{results}: neither a run_routing nor a run_vllm results.json")
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=None, help="directory (default: beside results.json)")
    args = p.parse_args()
    for path in write_plots(args.results, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
