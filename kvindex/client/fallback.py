"""Deciding without the index: the instances last seen, and a consistent hash of the prompt's start.

When the index is down or slow, a router must still send the request somewhere, and preferably where
its siblings went: requests sharing a prefix (a system prompt, a growing chat) should keep meeting
the cache they built. Rendezvous (highest-random-weight) hashing of the prompt's first blocks gives
that without coordination: every client replica with the same instance list picks the same instance
for the same prefix, and an instance leaving moves only the prefixes it held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.endpoint import BadEndpoint, check_endpoint

DEFAULT_BLOCK_SIZE = 16  # until the index has told the model's block size
CHARS_PER_TOKEN = 4  # text prompts: about four characters per token, enough for a prefix


@dataclass(slots=True)
class KnownInstance:
    """An instance as last reported by the index (ListInstances or a Score answer)."""

    instance_id: str
    endpoint: str  # "" when it announced none
    seen_at: float
    # Under prefill/decode disaggregation (ListInstances only; Score answers do not carry them):
    # "prefill", "decode" or "both", and the KV-transfer group ("" for none).
    role: str = "both"
    pd_group: str = ""


class InstanceCache:
    """Per model, the routable instances the index last reported, and the model's block size.

    ``replace`` (from ListInstances) makes each listed model's set exactly the listed one; a model
    absent from the listing keeps its last set (an index that just restarted lists nothing until the
    heartbeats come in, and that is when the fallback is needed). ``observe`` (from each Score answer)
    adds or refreshes the ranked instances. Nothing expires on its own: when the index is down the
    last known fleet is the best knowledge there is.

    ``static`` (model -> instances, :func:`static_instances`) is what the fallback uses for a model
    the index has never reported to this client: a cold start while the index is down still routes.
    Once the index reports the model (even with no routable instance), its report wins.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        static: Mapping[str, Sequence[KnownInstance]] | None = None,
    ) -> None:
        self.clock = clock
        self._models: dict[str, dict[str, KnownInstance]] = {}
        self._static = {m: list(v) for m, v in (static or {}).items() if v}
        self._block_size: dict[str, int] = {}
        self.refreshed_at: float | None = None  # last full ListInstances

    def replace(self, instances: Iterable[pb.InstanceInfo]) -> None:
        now = self.clock()
        models: dict[str, dict[str, KnownInstance]] = {}
        for info in instances:
            if info.block_size:
                self._block_size[info.model] = info.block_size
            members = models.setdefault(info.model, {})
            if not info.pool and not info.stale:  # the index would not rank them either
                # (getattr: an index that predates the fields has none, and serves whole requests.)
                role = getattr(info, "role", "") or "both"
                group = getattr(info, "pd_group", "")
                members[info.instance_id] = KnownInstance(info.instance_id, info.endpoint, now, role, group)
        self._models.update(models)
        self.refreshed_at = now

    def observe(self, response: pb.ScoreResponse) -> None:
        if not response.ranked:
            return
        now = self.clock()
        if response.block_size:
            self._block_size[response.model] = response.block_size
        members = self._models.setdefault(response.model, {})
        for r in response.ranked:
            known = members.get(r.instance_id)
            if known is None:
                members[r.instance_id] = KnownInstance(r.instance_id, r.endpoint, now)
            else:
                known.endpoint, known.seen_at = r.endpoint, now

    def instances(self, model: str) -> list[KnownInstance]:
        """The instances last seen for ``model``; the static ones if the index never reported it."""
        seen = self._models.get(model)
        if seen is None:
            return list(self._static.get(model, ()))
        return list(seen.values())

    def seen(self, model: str) -> bool:
        """Whether the index has reported ``model`` (else :meth:`instances` is the static list)."""
        return model in self._models

    def block_size(self, model: str) -> int | None:
        return self._block_size.get(model)

    def models(self) -> list[str]:
        return list(dict.fromkeys([*self._models, *self._static]))


def static_instances(spec: Mapping[str, Iterable[str]]) -> dict[str, list[KnownInstance]]:
    """Per model, the instances of ``fallback_instances=``: each ``HOST:PORT`` (its instance id is
    the endpoint) or ``ID=HOST:PORT`` with the instance id as the index names it (``node-3/0``; a
    bare worker id ``node-3`` means its rank 0, as ``kvindex serve --instance`` names it). Naming
    them as the index does makes a cold fallback pick what a warm one would. ValueError naming a
    bad entry."""
    out: dict[str, list[KnownInstance]] = {}
    if isinstance(spec, str) or not isinstance(spec, Mapping):
        raise ValueError("fallback_instances: want a mapping model -> ['HOST:PORT' or 'ID=HOST:PORT', ...]")
    for model, entries in spec.items():
        if not isinstance(model, str) or not model:
            raise ValueError(f"fallback_instances: model {model!r} is not a non-empty string")
        if isinstance(entries, str):
            raise ValueError(f"fallback_instances[{model!r}]: want a list, not the string {entries!r}")
        members: dict[str, KnownInstance] = {}
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(f"fallback_instances[{model!r}]: entry {entry!r} is not a string")
            name, sep, endpoint = entry.rpartition("=")
            try:
                check_endpoint(endpoint)
            except BadEndpoint as exc:
                raise ValueError(f"fallback_instances[{model!r}]: {entry!r}: {exc}") from None
            if sep and not name:
                raise ValueError(f"fallback_instances[{model!r}]: {entry!r}: empty instance id before '='")
            instance_id = (name if "/" in name else f"{name}/0") if sep else endpoint
            members[instance_id] = KnownInstance(instance_id, endpoint, 0.0)
        if members:
            out[model] = list(members.values())
    return out


def prefix_key(
    *,
    token_ids: Sequence[int] | None = None,
    block_keys: Sequence[int] | None = None,
    prompt: str | None = None,
    messages: Any = None,
    block_size: int | None = None,
    blocks: int = 4,
) -> int:
    """A 64-bit hash of the prompt's first ``blocks`` blocks, whatever form the prompt is in.

    Token ids: the first ``blocks x block_size`` tokens; block keys: the first ``blocks`` keys (each
    already covers its prefix); text: the first ``blocks x block_size x 4`` characters of the prompt,
    or of the chat messages as canonical JSON. Prompts shorter than that hash whole.
    """
    size = block_size or DEFAULT_BLOCK_SIZE
    if block_keys is not None and len(block_keys):
        head = np.asarray(list(block_keys)[:blocks], dtype=np.uint64).tobytes()
        return xxhash.xxh3_64_intdigest(b"k" + head)
    if token_ids is not None and len(token_ids):
        head = np.asarray(list(token_ids)[: blocks * size], dtype=np.uint32).tobytes()
        return xxhash.xxh3_64_intdigest(b"t" + head)
    chars = blocks * size * CHARS_PER_TOKEN
    if prompt is not None:
        return xxhash.xxh3_64_intdigest(b"p" + prompt[:chars].encode())
    if messages is not None:
        text = (
            messages
            if isinstance(messages, str)
            else json.dumps(messages, sort_keys=True, separators=(",", ":"))
        )
        return xxhash.xxh3_64_intdigest(b"m" + text[:chars].encode())
    return 0


class Fallback(Protocol):
    """Orders the known instances of a model for a prompt (best first) without the index."""

    def choose(self, key: int, instances: Sequence[KnownInstance]) -> list[KnownInstance]: ...


class RendezvousFallback:
    """Highest random weight: each instance's weight is a hash of (prefix key, instance id).

    Instances that announced an endpoint are preferred (a proxy can only send to those); the rest
    follow, in their own rendezvous order, for callers that route by instance id.
    """

    def choose(self, key: int, instances: Sequence[KnownInstance]) -> list[KnownInstance]:
        def weight(known: KnownInstance) -> tuple[bool, int]:
            return (bool(known.endpoint), xxhash.xxh3_64_intdigest(known.instance_id.encode(), seed=key))

        return sorted(instances, key=weight, reverse=True)
