"""The pure decisions of disaggregated routing (kvindex/route/pd.py): when the decode instance
prefills itself, which prefill instance is cheapest with the KV transfer, what the pair costs, and
the two requests of vLLM's disaggregated protocol."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kvindex.route.pd import (
    CACHED_ON_DECODE,
    SHORT_INPUT,
    PairCosts,
    PdConfig,
    PrefillOption,
    choose_prefill,
    decide_local,
    decode_body,
    decode_candidates,
    kv_params_of,
    parse_pair_cost,
    prefill_body,
    prefill_candidates,
)


@dataclass
class M:
    instance_id: str
    role: str = "both"
    pd_group: str = ""
    endpoint: str = "h:1"


def test_conditional_disaggregation_follows_dynamos_defaults() -> None:
    cfg = PdConfig()
    assert decide_local(2047, 0, cfg) == SHORT_INPUT
    assert decide_local(2048, 0, cfg) is None
    # The decode instance holds 40 % of a long prompt: 60 % uncached < 0.7, it prefills itself.
    assert decide_local(10_000, 4_000, cfg) == CACHED_ON_DECODE
    assert decide_local(10_000, 3_000, cfg) is None  # exactly 0.7 uncached: worth a remote prefill
    assert decide_local(100, 0, PdConfig(min_input_tokens=0, min_uncached_share=0.0)) is None
    with pytest.raises(ValueError, match="min_uncached_share"):
        PdConfig(min_uncached_share=1.5)


def test_candidates_by_role_group_and_endpoint() -> None:
    fleet = [
        M("p0/0", "prefill", "a"), M("p1/0", "prefill", "b"), M("b0/0", "both", "a"),
        M("d0/0", "decode", "a"), M("d1/0", "decode", "c"), M("x/0", "prefill", "a", endpoint=""),
    ]  # fmt: skip
    assert decode_candidates(fleet) == ["b0/0", "d0/0", "d1/0"]
    assert prefill_candidates(fleet, "d0/0", "a", same_group=False) == ["b0/0", "p0/0", "p1/0"]
    assert prefill_candidates(fleet, "d0/0", "a", same_group=True) == ["b0/0", "p0/0"]
    # Nobody in the decode instance's group: any prefill instance rather than none.
    assert prefill_candidates(fleet, "d1/0", "c", same_group=True) == ["b0/0", "p0/0", "p1/0"]
    # A "both" instance picked to decode does not also prefill remotely for itself.
    assert prefill_candidates(fleet, "b0/0", "a", same_group=True) == ["p0/0"]


def test_prefill_pick_adds_the_transfer_per_pair() -> None:
    cfg = PdConfig(transfer_ms_per_1k=1.0, pair_ms_per_1k={("p0", "d0"): 50.0})
    costs = PairCosts(cfg)
    options = [PrefillOption("p0/0", "a:1", 100.0), PrefillOption("p1/0", "b:1", 180.0)]
    # 4,000 tokens to move: p0 (100 + 200) loses to p1 (180 + 4) on the transfer alone.
    pick = choose_prefill(options, "d0/0", 4000, costs)
    assert pick is not None and pick.option.instance_id == "p1/0"
    assert (pick.transfer_ms, pick.total_ms) == (4.0, 184.0)
    # Nothing to move (the decode instance holds it all): the index's TTFT alone decides.
    pick = choose_prefill(options, "d0/0", 0, costs)
    assert pick is not None and pick.option.instance_id == "p0/0"
    assert choose_prefill([PrefillOption("d0/0", "d:1", 1.0)], "d0/0", 10, costs) is None


def test_pair_costs_given_then_measured_then_default() -> None:
    costs = PairCosts(PdConfig(transfer_ms_per_1k=2.0, pair_ms_per_1k={("p0/0", "d0/0"): 9.0}), min_samples=3)
    assert costs.per_1k("p0/0", "d0/0") == 9.0  # given, by instance id
    assert costs.per_1k("p1/0", "d0/0") == 2.0  # default until measured
    for ms in (20.0, 20.0):
        costs.observe("p1/0", "d0/0", 2000, ms)  # 10 ms per 1k
    assert costs.per_1k("p1/0", "d0/0") == 2.0  # two samples: not yet trusted
    costs.observe("p1/0", "d0/0", 2000, 20.0)
    assert costs.per_1k("p1/0", "d0/0") == pytest.approx(10.0)
    costs.observe("p1/0", "d0/0", 1000, 20.0)  # 20 per 1k, weighted 0.2
    assert costs.per_1k("p1/0", "d0/0") == pytest.approx(12.0)
    off = PairCosts(PdConfig(measure=False))
    off.observe("a/0", "b/0", 1000, 500.0)
    assert off.per_1k("a/0", "b/0") == 2.0 and off.measured() == {}


def test_pair_cost_flag() -> None:
    assert parse_pair_cost("node-1=node-2:3.5") == (("node-1", "node-2"), 3.5)
    assert parse_pair_cost("p/0=d/1:0") == (("p/0", "d/1"), 0.0)
    for bad in ("p=d", "p:1", "=d:1", "p=d:fast", "p=d:-1", "p=d:nan"):
        with pytest.raises(ValueError, match="pair cost"):
            parse_pair_cost(bad)


def test_the_two_requests_of_vllms_protocol() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "max_completion_tokens": 50,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.3}  # fmt: skip
    first = json.loads(prefill_body(body))
    assert first["max_tokens"] == 1 and first["max_completion_tokens"] == 1 and first["stream"] is False
    assert "stream_options" not in first and first["temperature"] == 0.3
    assert first["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1, 2]]}
    second = json.loads(decode_body(body, params))
    assert second == {**body, "kv_transfer_params": params}  # the client's request, untouched otherwise
    assert body.get("kv_transfer_params") is None  # not modified in place
    answer = json.dumps({"choices": [], "kv_transfer_params": params}).encode()
    assert kv_params_of(answer) == params
    for no in (b'{"kv_transfer_params": null}', b'{"kv_transfer_params": {}}', b"[1]", b"not json"):
        assert kv_params_of(no) is None
