"""Each model's KV-cache group layout, learned from its workers' heartbeats (docs/wire.md §8).

A hybrid-attention model's blocks are read by vLLM's rule over its groups (kvindex/index/hybrid.py),
so the index must know the layout, and every instance of the model must have the same one:

- the first layout a worker of the model announces is the model's, as its block size is; it goes
  with the model's last instance (a lone instance that announces another one replaces it: a
  restart with another configuration);
- an instance announcing another layout is refused (``group_layout_mismatch``, counted, logged with
  its worker id): its blocks are dropped and its batches refused until it announces the model's, since
  they would be read by the wrong rule; it stays routable, as an instance whose cache is unknown;
- an instance whose answers are not the engine's rule says so (``InstanceState.groups_inexact``: a
  kind the index does not understand, groups of other block sizes, events of a group its layout does
  not list, a layout that cannot be read): ``ListInstances`` and ``kvindex_instances_by_state`` show it
  ``approximate`` with the reason, logged once per change.
"""

from __future__ import annotations

from typing import Any

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import KvBlockIndex
from kvindex.index.hybrid import GroupLayout
from kvindex.ingest.rejects import Rejects
from kvindex.wire import errors
from kvindex.wire.errors import WireError
from kvindex.wire.groups import GroupSpec

_MAX_CACHED = 256


class Layouts:
    """The layout bookkeeping of ingest: the heartbeats tell it what instances announce, the applier
    which groups their batches name."""

    def __init__(self, index: KvBlockIndex, registry: Registry, log: Any, rejects: Rejects) -> None:
        self.index = index
        self.registry = registry
        self.log = log
        self.rejects = rejects
        # GroupLayout per announced (groups, block size): built once, shared by a model's instances.
        self._built: dict[tuple[tuple[GroupSpec, ...], int], GroupLayout] = {}

    def layout(self, specs: tuple[GroupSpec, ...], block_size: int) -> GroupLayout:
        key = (specs, block_size)
        layout = self._built.get(key)
        if layout is None:
            if len(self._built) >= _MAX_CACHED:
                self._built.clear()
            layout = self._built[key] = GroupLayout(specs, block_size)
        return layout

    def announced(self, state: InstanceState, specs: tuple[GroupSpec, ...] | None, error: str | None) -> bool:
        """A heartbeat of ``state`` announced ``specs`` (None: no groups, or ``error`` when its groups
        could not be read). Called when the announcement differs from the instance's last one.

        True when the instance comes out of a conflict: its blocks were dropped and its batches
        refused, so a snapshot must bring them back. The caller asks for it (the heartbeats hold the
        repair machine, this does not), then has the instance judged (``judge``)."""
        state.groups_announced = specs
        if error is not None:
            self._refuse(state, WireError(errors.BAD_GROUPS, error))
            self._inexact(state, f"KV-cache groups unreadable: {error}")
            return False
        model_layout = self.index.layout_of(state.model)
        layout = None if specs is None else self.layout(specs, state.block_size)
        alone = self.registry.count(state.model) <= 1
        if layout is None:
            # Not (yet) announced: a bridge learns an engine's groups from its first stores, and an
            # older one never announces them. Its group-0 events are read by the model's rule (a
            # safe under-estimate: group 0 alone serves no hit of a hybrid model), and it says so.
            if alone and model_layout is not None:
                self.index.set_layout(state.model, GroupLayout.single(state.block_size))
        elif model_layout is None or alone:
            self.index.set_layout(state.model, layout)
            if model_layout != layout and (model_layout is not None or layout.hybrid):
                self.log.info(
                    "model_kv_groups",
                    model=state.model,
                    worker=state.worker,
                    dp_rank=state.dp_rank,
                    groups=layout.describe(),
                )
        elif model_layout != layout:
            self._conflict(state, f"announces {layout.describe()}; the model has {model_layout.describe()}")
            return False
        if state.layout_conflict:
            state.layout_conflict = False
            return True
        self.judge(state)
        return False

    def events_named(self, state: InstanceState, top_group: int) -> None:
        """A batch of ``state`` named KV-cache groups up to ``top_group`` (> the last highest seen)."""
        state.top_group = top_group
        # Until a layout is announced, the next heartbeat judges: a bridge's first stores come
        # before the heartbeat that announces what it learned from them.
        if isinstance(state.groups_announced, tuple) and state.groups_announced and not state.layout_conflict:
            self.judge(state)

    def judge(self, state: InstanceState) -> None:
        """Whether the instance's answers are the engine's rule (``groups_inexact``)."""
        specs = state.groups_announced
        current = self.index.layout_of(state.model)
        if specs is None:
            if state.top_group > 0:
                why = f"events of KV-cache group {state.top_group}, and no layout announced"
            elif current is not None and current.hybrid:
                why = f"announces no KV-cache groups; the model has {current.describe()}"
            else:
                why = ""
        elif current is not None and not current.understood:
            why = current.why
        elif state.top_group >= len(specs):
            why = f"events of KV-cache group {state.top_group}, which its layout does not list"
        else:
            why = ""
        self._inexact(state, why)

    def _refuse(self, state: InstanceState, exc: WireError) -> None:
        self.rejects.refuse(state.key, exc.reason, exc.message)

    def _conflict(self, state: InstanceState, why: str) -> None:
        self._refuse(state, WireError(errors.GROUP_LAYOUT_MISMATCH, why))
        if not state.layout_conflict:
            state.layout_conflict = True
            self.index.clear(state.key)
        self._inexact(state, f"KV-cache groups differ from the model's: {why}")

    def _inexact(self, state: InstanceState, why: str) -> None:
        if why == state.groups_inexact:
            return
        state.groups_inexact = why
        if why:
            self.log.warning(
                "instance_kv_groups_approximate", worker=state.worker, dp_rank=state.dp_rank, reason=why
            )
        else:
            self.log.info("instance_kv_groups_exact", worker=state.worker, dp_rank=state.dp_rank)
