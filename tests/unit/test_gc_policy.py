"""The service's garbage-collection policy (kvindex/service/gc_policy.py): a freeze keeps the fleet's
objects out of collections; the periodic full pass still frees garbage cycles among them."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from kvindex.service.gc_policy import GcConfig, GcPolicy


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


def test_frozen_cycles_are_freed_by_the_full_pass() -> None:
    now = [0.0]
    log = Log()
    policy = GcPolicy(GcConfig(freeze_every=1.0, full_every=10.0), log, clock=lambda: now[0])
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the steps below
    try:
        node = Node()
        freed = weakref.ref(node)
        del node
        policy.tick()  # frozen with everything else alive
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert freed() is not None  # a collection does not look at frozen objects
        now[0] = 5.0
        policy.tick()
        assert freed() is not None and log.events == []
        now[0] = 10.0
        policy.tick()  # due: unfrozen, collected, frozen again
        assert freed() is None
        assert [event for event, _ in log.events] == ["gc_full"] and log.events[0][1]["freed"] >= 2
        assert gc.get_freeze_count() > 0 and policy.freezes == 3 and policy.full_collections == 1
    finally:
        policy.stop()
        if was_enabled:
            gc.enable()
    assert gc.get_freeze_count() == 0


def test_disabled_policy_leaves_the_collector_alone() -> None:
    policy = GcPolicy(GcConfig(enabled=False), Log())
    policy.stop()
    assert gc.get_freeze_count() == 0


def test_serve_flags() -> None:
    """``kvindex serve --gc-freeze-every/--gc-full-every`` set the policy (0: off); bad values exit 2."""
    import pytest

    from kvindex.cli import _service_config, build_parser

    def config(*flags: str) -> GcConfig:
        args = build_parser().parse_args(["serve", *flags])
        return _service_config(args, None, None, None, None).gc

    assert config() == GcConfig()
    assert config("--gc-freeze-every", "5", "--gc-full-every", "600") == GcConfig(True, 5.0, 600.0)
    assert not config("--gc-freeze-every", "0").enabled
    for bad in (["--gc-freeze-every", "-1"], ["--gc-full-every", "0"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", *bad])
        assert exc.value.code == 2
