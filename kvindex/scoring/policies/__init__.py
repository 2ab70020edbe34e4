"""Ranking policies: ours (``ttft``) and the peers', each as published
(docs/scoring.md, Peer policies).

One module per policy; each exposes a class with ``name``, ``speculative_ttl``, ``rank`` and
``on_commit`` (kvindex/scoring/base.py). ``make_policies`` builds one instance of each; options
per policy (e.g. ``{"loadaware": {"beta": 0.5}}``) override published defaults.
"""

from __future__ import annotations

from typing import Any

from kvindex.scoring.base import Policy
from kvindex.scoring.policies.cache_aware import CacheAware
from kvindex.scoring.policies.decode import DecodeHeadroom
from kvindex.scoring.policies.dynamo import Dynamo
from kvindex.scoring.policies.flexlb import FlexLB
from kvindex.scoring.policies.kvaware import KvAware
from kvindex.scoring.policies.llmd import LlmdPrecise
from kvindex.scoring.policies.loadaware import LoadAware
from kvindex.scoring.policies.overlap import Overlap
from kvindex.scoring.policies.power_of_two import PowerOfTwo
from kvindex.scoring.policies.preble import Preble
from kvindex.scoring.policies.prefix_hash import PrefixHash
from kvindex.scoring.policies.round_robin import RoundRobin
from kvindex.scoring.policies.ttft import Ttft

POLICY_CLASSES: dict[str, Any] = {
    cls.name: cls
    for cls in (
        Ttft,
        Overlap,
        KvAware,
        RoundRobin,
        PowerOfTwo,
        PrefixHash,
        CacheAware,
        LoadAware,
        Dynamo,
        LlmdPrecise,
        FlexLB,
        Preble,
        DecodeHeadroom,
    )
}
# Selectable by routers (the decode ranking is chosen by the request's role instead).
POLICY_NAMES = tuple(name for name in POLICY_CLASSES if name != "decode")


def make_policies(options: dict[str, dict[str, Any]]) -> dict[str, Policy]:
    unknown = set(options) - set(POLICY_CLASSES)
    if unknown:
        raise ValueError(f"options for unknown policies: {sorted(unknown)}")
    return {name: cls(**options.get(name, {})) for name, cls in POLICY_CLASSES.items()}
