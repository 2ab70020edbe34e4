"""`kvindex serve`'s listen-address parser. Where the running process listens:
tests/integration/test_serve_listen.py."""

from __future__ import annotations

import pytest

from kvindex.api.listen import parse_listen, route_exposure


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:4222") == ("0.0.0.0", 4222)
    assert parse_listen("[::]:0") == ("::", 0)
    for bad in ("4222", ":4222", "host:x", "host:70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_the_routing_proxy_is_exposed_beyond_loopback() -> None:
    # serve --route-host and kvindex route --host: plain HTTP without authentication.
    assert route_exposure("0.0.0.0", 8080) == (
        "route 0.0.0.0:8080 (plain HTTP, no authentication: anyone can send requests)"
    )
    assert route_exposure("::", 8080) is not None and route_exposure("10.1.2.3", 1).startswith(
        "route 10.1.2.3:1"
    )
    assert route_exposure("127.0.0.1", 8080) is None and route_exposure("localhost", 8080) is None
