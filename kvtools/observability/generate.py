"""Write (or check) everything under deploy/observability/ that is generated: the Grafana dashboards
(dashboards.py, via grafana.py) and the alerting rules in both forms (alerts.py).

    python -m kvtools.observability.generate            # rewrite the files
    python -m kvtools.observability.generate --check    # exit 1 naming the files that differ

Needs the ``observability`` extra (grafana-foundation-sdk, PyYAML).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtools.observability import alerts, grafana
from kvtools.observability.dashboards import DASHBOARDS

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "deploy" / "observability"
RULES = OUT / "alerts" / "kvindex-rules.yaml"
PROMETHEUS_RULE = OUT / "alerts" / "kvindex-prometheusrule.yaml"


def outputs(runbook: str = alerts.RUNBOOK) -> dict[Path, str]:
    """Every generated file and its content."""
    files = {OUT / "dashboards" / f"{board.uid}.json": grafana.render(board) for board in DASHBOARDS}
    files[RULES] = alerts.render_rules(runbook=runbook)
    files[PROMETHEUS_RULE] = alerts.render_prometheus_rule(runbook=runbook)
    return files


def stale(files: dict[Path, str]) -> list[Path]:
    """The files whose committed content is not the generated one (missing ones included)."""
    return [p for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    parser.add_argument(
        "--runbook-base", default=alerts.RUNBOOK, help="runbook_url prefix (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    files = outputs(args.runbook_base)
    if args.check:
        differ = stale(files)
        for path in differ:
            print(f"{path.relative_to(ROOT)} is not what kvtools/observability generates", file=sys.stderr)
        if differ:
            print("regenerate: python -m kvtools.observability.generate", file=sys.stderr)
        return 1 if differ else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
