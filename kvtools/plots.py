"""PNG plots of routing results (the ``plots`` extra: matplotlib), shared by the routing simulation
(benchmarks/routing_sim.py) and the real-engine runs (e2e/plot_results.py):

- ``load_curves``: TTFT (p50 and p90) and SLO goodput against load, one line per policy or router;
- ``predicted_vs_actual``: what was predicted against what was measured, one point per request, with
  the diagonal (and, for TTFT, the x2 / x0.5 band).

Small files on purpose (they are committed under docs/img/): modest size and dpi, at most
``MAX_POINTS`` points per series (an even subsample), no transparency.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_POINTS = 2000
DPI = 80
OURS = ("ttft", "kvindex")  # drawn thicker: ours (ttft and its variants; kvindex routers)


@dataclass(frozen=True)
class LoadPoint:
    """One policy at one load: TTFT percentiles in seconds, goodput as a share (0-1)."""

    policy: str
    load: str  # the load's label, in the order the points come
    ttft_p50: float
    ttft_p90: float
    goodput: float


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _ours(policy: str) -> bool:
    return policy.startswith(OURS)


def load_curves(
    points: Sequence[LoadPoint], path: Path, title: str, objective_s: float | None = None
) -> Path:
    """TTFT p50 (solid) and p90 (dashed) against load, and goodput against load, per policy."""
    plt = _pyplot()
    loads = list(dict.fromkeys(p.load for p in points))
    xs = {load: i for i, load in enumerate(loads)}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for n, policy in enumerate(dict.fromkeys(p.policy for p in points)):
        mine = [p for p in points if p.policy == policy]
        x = [xs[p.load] for p in mine]
        width = 2.4 if _ours(policy) else 1.1
        color = f"C{n % 10}"
        a1.plot(x, [p.ttft_p50 for p in mine], marker="o", color=color, linewidth=width, label=policy)
        a1.plot(x, [p.ttft_p90 for p in mine], marker="^", color=color, linewidth=width, linestyle="--")
        a2.plot(x, [100 * p.goodput for p in mine], marker="o", color=color, linewidth=width, label=policy)
    if objective_s:
        a1.axhline(objective_s, color="grey", linewidth=0.8, linestyle=":", label="TTFT objective")
    a1.set_yscale("log")
    _plain(a1.yaxis)
    a1.set_ylabel("TTFT (s): p50 —, p90 - -" + (", objective ···" if objective_s else ""), fontsize=9)
    a2.set_ylabel("goodput (% within the TTFT objective)")
    a2.set_ylim(0, 105)
    for a in (a1, a2):
        a.set_xticks(range(len(loads)), loads, fontsize=8)
        a.set_xlabel("load")
        a.grid(alpha=0.3)
    a2.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def predicted_vs_actual(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    title: str,
    unit: str = "s",
    log: bool = True,
    band: float | None = 2.0,
) -> Path:
    """Predicted (x) against measured (y), one point per request, per series; the diagonal, and with
    ``band`` the lines x ``band`` and / ``band`` around it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    values: list[float] = []
    for n, (name, pairs) in enumerate(series.items()):
        kept = [(x, y) for x, y in pairs if (x > 0 and y > 0) or not log]
        step = max(1, len(kept) // MAX_POINTS)
        kept = kept[::step]
        if not kept:
            continue
        values += [v for pair in kept for v in pair]
        ax.scatter([x for x, _ in kept], [y for _, y in kept], s=6, alpha=0.5, color=f"C{n % 10}",
                   label=f"{name} ({len(pairs):,})")  # fmt: skip
    if values:
        lo, hi = min(values), max(values)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            _plain(ax.xaxis)
            _plain(ax.yaxis)
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="measured = predicted")
        if band and log:
            for f in (band, 1 / band):
                ax.plot([lo, hi], [lo * f, hi * f], color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel(f"predicted ({unit})")
    ax.set_ylabel(f"measured ({unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", markerscale=2)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _plain(axis) -> None:  # type: ignore[no-untyped-def]
    """Log-scale ticks as plain numbers (0.5, not 5x10^-1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
