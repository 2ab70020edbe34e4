"""What an instance does under prefill/decode disaggregation: its ``role`` and ``pd_group`` as announced
in its heartbeats (docs/wire.md §4).

One parser for every party (publisher, index decoder, CLI), as for endpoints:

- ``role`` is ``prefill`` (computes prompts' KV and hands it over), ``decode`` (receives the KV and
  generates) or ``both`` (serves whole requests, and either half); absent means ``both``, which is
  what every worker that predates the field does;
- ``pd_group`` names the KV-transfer domain the instance belongs to (a rack, an NVLink or RDMA island):
  a router may keep a request's prefill in its decode instance's group. ``[A-Za-z0-9_.-]{1,128}``;
  absent means no group.
"""

from __future__ import annotations

import re
from typing import Final

PREFILL: Final = "prefill"
DECODE: Final = "decode"
BOTH: Final = "both"
ROLES: Final = (PREFILL, DECODE, BOTH)
# Roles that may serve each half of a disaggregated request.
PREFILLS: Final = frozenset({PREFILL, BOTH})
DECODES: Final = frozenset({DECODE, BOTH})

_GROUP = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class BadRole(ValueError):
    """A role or group that is not one the wire allows; the message says what is wrong."""


def check_role(value: object) -> str:
    """``value`` if it is a role; BadRole otherwise."""
    if not isinstance(value, str) or value not in ROLES:
        shown = repr(value) if isinstance(value, str) else type(value).__name__
        raise BadRole(f"role must be one of {', '.join(ROLES)}; got {shown}")
    return value


def check_group(value: object) -> str:
    """``value`` if it is a group name; BadRole otherwise."""
    if not isinstance(value, str) or not _GROUP.fullmatch(value):
        shown = repr(value[:140]) if isinstance(value, str) else type(value).__name__
        raise BadRole(f"pd_group must match [A-Za-z0-9_.-]{{1,128}}; got {shown}")
    return value
