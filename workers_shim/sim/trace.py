"""Mooncake-format traces as simulated requests.

A row is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` (and
``"ttft_slo_ms": ms`` if the trace sets objectives) with one hash id per 512-token block (the last
one possibly partial); equal ids mean equal prefixes. Each id is
turned into 512 deterministic token ids (id h → h·512 … h·512+511, mod 2^32), so the prompt has real
tokens and its keys are the wire's keys (``kvindex.keys.block_keys``) at any block size: a router
that asks kvindex with these tokens, and the engines that cache them, agree.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvindex.keys import block_keys
from workers_shim.sim.engine import SimRequest

__all__ = ["TRACE_BLOCK", "mooncake_requests", "mooncake_rows", "mooncake_tokens"]

TRACE_BLOCK = 512
_OFFSETS = np.arange(TRACE_BLOCK, dtype=np.uint64)


def mooncake_rows(path: str | Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a ``.jsonl`` or gzip-compressed ``.jsonl.gz`` trace, read line by line (streaming)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            if line.strip():
                yield json.loads(line)


def mooncake_tokens(hash_ids: list[int], input_length: int) -> np.ndarray:
    """The prompt's token ids (uint32): block j holds hash_ids[j]·512 + 0…511, cut at input_length."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    tokens = (ids[:, None] * TRACE_BLOCK + _OFFSETS[None, :]).reshape(-1) & np.uint64(0xFFFFFFFF)
    return tokens[:input_length].astype(np.uint32)


def mooncake_requests(
    path: str | Path,
    *,
    model: str,
    block_size: int = TRACE_BLOCK,
    limit: int | None = None,
    time_scale: float = 1.0,
    id_prefix: str = "r",
) -> list[SimRequest]:
    """Requests of a Mooncake trace: arrival = timestamp (ms → s) x ``time_scale`` (0.5 = twice the
    load); keys of the full blocks at ``block_size`` for ``model``."""
    out: list[SimRequest] = []
    for i, row in enumerate(mooncake_rows(path, limit)):
        n = int(row["input_length"])
        tokens = mooncake_tokens(row["hash_ids"], n)
        out.append(
            SimRequest(
                id=f"{id_prefix}{i}",
                keys=block_keys(tokens, block_size, model),
                prompt_tokens=n,
                output_tokens=max(1, int(row["output_length"])),
                arrival=row["timestamp"] / 1000.0 * time_scale,
                meta=row["hash_ids"],
                ttft_slo_s=float(row["ttft_slo_ms"]) / 1000.0 if row.get("ttft_slo_ms") else None,
            )
        )
    return out
