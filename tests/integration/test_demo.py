"""`make run` (python -m kvtools.demo): service, simulated fleet and trace-driven traffic through gRPC."""

from __future__ import annotations

import re
import subprocess
import sys

from kvtools.data import mooncake_trace


def test_demo_routes_requests_end_to_end() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtools.demo",
            "--duration",
            "10",
            "--plain",
            "--report-every",
            "3",
            "--grpc-port",
            "0",
            "--metrics-port",
            "-1",
            "--instances",
            "4",
            "--limit",
            "400",
            "--trace",
            str(mooncake_trace()),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    final = re.search(r"stopped: (\d+) requests routed, (\d+) first tokens, (\d+) errors", out.stdout)
    assert final, out.stdout
    routed, first, errors = map(int, final.groups())
    assert routed > 20 and first > 10 and errors == 0
    # The summary lines report estimated next to simulated TTFT and the index's view.
    assert re.search(r"ttft est \d+\.\d+s sim \d+\.\d+s", out.stdout)
    # ... and the index's verdicts on its cache predictions, checked against the engines' answers.
    verdicts = re.findall(
        r"predicted vs engine: exact (\d+\.\d)% \(([\d,]+)\), over ([\d,]+), under ([\d,]+)", out.stdout
    )
    assert verdicts, out.stdout
    share, exact, _over, _under = verdicts[-1]
    assert int(exact.replace(",", "")) > 10 and float(share) > 50.0
