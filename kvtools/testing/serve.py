"""The command line of a ``kvindex serve`` child process on loopback, for tests and tools that run
the real service in its own process (soak, end-to-end tests)."""

from __future__ import annotations

import sys
from pathlib import Path


def kvindex_exe() -> str:
    """The ``kvindex`` entry point installed next to this interpreter."""
    return str(Path(sys.executable).with_name("kvindex"))


def serve_argv(nats_url: str, grpc_port: int, metrics_port: int = -1, *extra: str) -> list[str]:
    """``kvindex serve`` against ``nats_url``, gRPC (and metrics, unless -1) on 127.0.0.1."""
    argv = [kvindex_exe(), "serve", "--nats", nats_url, "--grpc-host", "127.0.0.1"]
    argv += [
        "--grpc-port",
        str(grpc_port),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(metrics_port),
    ]
    return argv + list(extra)
