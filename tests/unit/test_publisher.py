"""The publisher library's argument checks, without a connection. Against a real nats-server:
tests/integration/test_publisher.py."""

from __future__ import annotations

import pytest

from workers_shim.publisher import Publisher


def test_argument_checks() -> None:
    with pytest.raises(ValueError):
        Publisher(None, worker="bad id", model="m", block_size=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Publisher(None, worker="w", model="m", block_size=0)  # type: ignore[arg-type]
