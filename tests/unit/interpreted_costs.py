"""The cost model as Python: kvindex/scoring/costs.py loaded from its source, not from the extension
Cython compiled it into (what an install without a C compiler runs), and a context in which the
rankings price with it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from unittest import mock

from kvindex.scoring import candidates, costs, fleet_table, pool

# Where the rankings hold the cost model's functions (imported by name).
USERS = (candidates, fleet_table, pool)


@functools.cache
def interpreted() -> ModuleType:
    path = costs.__file__.rsplit(".", 1)[0].split(".cpython")[0]
    spec = importlib.util.spec_from_file_location("kvindex_costs_interpreted", path + ".py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def compiled() -> bool:
    """Whether the installed cost model is the compiled one."""
    return not costs.__file__.endswith(".py")


@contextlib.contextmanager
def interpreted_cost_model() -> Iterator[ModuleType]:
    """The rankings price with the interpreted cost model for the duration."""
    python = interpreted()
    with contextlib.ExitStack() as stack:
        for user in USERS:
            for name, value in vars(user).items():
                ours = getattr(value, "__module__", None) == costs.__name__ and callable(value)
                if ours and hasattr(python, name) and not isinstance(value, type):
                    stack.enter_context(mock.patch.object(user, name, getattr(python, name)))
        yield python
