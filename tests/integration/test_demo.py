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
    # How long the trace lasts, said at once (issue 31), and the load as measured.
    assert re.search(r"^load: trace average .*; .*the trace lasts \d+ (min|s)", out.stdout, re.M), out.stdout
    rates = re.findall(r"offered (\d+\.\d)/s served (\d+\.\d)/s", out.stdout)
    assert rates and float(rates[-1][0]) > 0 and float(rates[-1][1]) > 0, out.stdout
    # Estimated next to simulated TTFT, on the same recent requests: they agree, the index pricing
    # the simulated engines' own costs (with its default, a 70B model, the first estimates of these
    # 8B engines were ~4x their TTFT, and the mean over this run's 10 s 2-3x).
    ttft = re.findall(r"ttft est (\d+\.\d+)s sim (\d+\.\d+)s", out.stdout)
    assert ttft, out.stdout
    est, sim = map(float, ttft[-1])
    assert 0.7 < est / sim < 1.4, out.stdout
    # ... and the index's verdicts on its cache predictions, checked against the engines' answers.
    verdicts = re.findall(
        r"predicted vs engine: exact (\d+\.\d)% \(([\d,]+)\), over ([\d,]+), under ([\d,]+)", out.stdout
    )
    assert verdicts, out.stdout
    share, exact, _over, _under = verdicts[-1]
    assert int(exact.replace(",", "")) > 10 and float(share) > 50.0
