"""`kvindex serve`'s listen-address parser. Where the running process listens:
tests/integration/test_serve_listen.py."""

from __future__ import annotations

import pytest

from kvindex.api.listen import parse_listen


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:4222") == ("0.0.0.0", 4222)
    assert parse_listen("[::]:0") == ("::", 0)
    for bad in ("4222", ":4222", "host:x", "host:70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)
