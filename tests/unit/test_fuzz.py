"""Every fuzz target (tests/fuzz/harness.py) uninstrumented: each seed passes its target, and every
input the fuzzer found is replayed. The short run under atheris: tests/integration/test_fuzz.py."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import harness  # noqa: E402


@pytest.mark.parametrize("target", sorted(harness.TARGETS))
def test_every_seed_passes_its_target(target: str) -> None:
    seeds = harness.seeds(target)
    assert seeds
    for seed in seeds:
        harness.TARGETS[target](seed)


# Inputs the fuzzer found that failed before their fix (docs/fuzzing.md), as base64.
FOUND = [
    # A snapshot answer whose only part is numbered -1 and last: an empty answer, IndexError in the
    # repairer's task, and the instance stuck "repairing" forever. Part numbers are now u64.
    ("snapshot", "AIi3iKF2AaZ3b3JrZXKidzKnZHBfcmFuawClZXBvY2gCo3NlcQCkcGFydP+kbGFzdMOliJaajXOA"),
    # An SGLang BlockStored whose token count does not match its blocks: the bridge's skip counter
    # raised TypeError (blocks= passed twice), losing the rest of the batch.
    (
        "bridge_sglang",
        "AJPLP/AAAAAAAACUl6tCbG9ja1N0b3JlZJH9QJQA//8DBMCjR1BVl6tCbG9ja1N0b3JlZJHR4Q4Ak8s/8AAAAAAAAJSXq0Js"
        "b2NrU3RvcmVkkf1AlAD//wMEwKNHUFWXq0Jsb2NrU3RvcmVkkdHhDgWU/QQGBwTAqkNQVV9QSU5ORUSTsEFsJkJsb2Nrc0Ns"
        "ZWFyZWRQVZGwQWxsQmxvY2tzQ2xlYXJlBZT9BAYHBMCqQ1BVX1BJTk5FRJOwQWwmQmxvY2tzQ2xlYXJlZFBVkbBBbGxCbG9j"
        "a3NDbGVhcmVkAA==",
    ),
    # SGLang bigram token pairs with a map among them: KeyError escaped the decoder.
    ("bridge_sglang", "AJPLP/AAAAAAAACUl6tCbG9ja1N0b3JlZJH9wJSSdG+AAgPAUFVkVWQA"),
    # Older-vLLM-shaped extra keys (lora_id, no lora_name) whose first items include a list: TypeError
    # (unhashable) escaped the decoder.
    (
        "bridge_sglang",
        "AJPLP/AAAAj/+pSTmatCbG9ja1N0b3JlZJH9Kf32cmXLP/AAAAj/+pSXmaRkYXR+YalCbG9ja1N0b3JlZJHTKf0AAAAA9tZl"
        "lAAACP/6lJeZq0Jsb2NrU3RvcmVkkf0p/fZyZZCkZWlwdP8BLYAIAAHScmllKf32cmXLP/AAAAj/+pQBLQgA",
    ),
    # A multimodal extra key whose offset does not fit in 64 signed bits: OverflowError escaped.
    (
        "bridge_sglang",
        "AJPLP/AA/5T6CACTmatCbG9ja1N0b3JlZJH9Kf32cmXLzvAAAAik+v+XlJlkYXQAAAD2cmWUAM+AAAAAAAAAAAAI+pT/l5mr"
        "QmxvY2tTdG9yZWSR/Sn99nJlkKRlaXB0/6dydW5uaW5nZaJvawiQpGUpcnT//1xhdHIBLQgA",
    ),
    # A TRT-LLM pull-API block with ``tokens`` an integer: TypeError escaped the decoder instead of
    # the event becoming an EventError.
    (
        "bridge_trtllm",
        "AJLLP/AAAAAAAACTg6hldmVudF9pZAGkZGF0YYOkdHlwZaZzdG9yZWSrcGFyZW50X2hhc2jApmJsb2Nrc5GDqmJsb2NrX2hh"
        "c2j9pnRva2Vuc3RfaWQDpGRhdGGCpHR5cGWncmVtbXZlZKxibG9ja19oQXNoZXOR/Q==",
    ),
]


@pytest.mark.parametrize(("target", "data"), FOUND)
def test_inputs_the_fuzzer_found(target: str, data: str) -> None:
    harness.TARGETS[target](base64.b64decode(data))


def test_multi_part_answers_complete_only_with_every_part() -> None:
    from kvindex.repair.nats_repair import _Parts
    from kvindex.wire.reconcile import SnapshotPart

    def part(n: int, last: bool = False) -> SnapshotPart:
        return SnapshotPart(1, "w", 0, 1, 1, n, last, {"gpu": [n]})

    parts = _Parts()
    # Parts beyond the last one used to count towards completion, leaving a real part missing.
    assert not parts.add(part(7)) and not parts.add(part(9))
    assert not parts.add(part(1, last=True))
    assert parts.add(part(0))
    assert [p.part for p in parts.ordered()] == [0, 1]
