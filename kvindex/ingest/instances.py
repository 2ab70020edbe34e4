"""Instances on first contact: the registry entry a batch or heartbeat belongs to, created when new,
within the limits on instances and models, and refused when it contradicts what the fleet already
said (another model or block size in the same epoch, a block size other than the model's)."""

from __future__ import annotations

from kvindex.fleet.registry import InstanceState
from kvindex.ingest.limits import INSTANCE_LIMIT, MODEL_LIMIT, IngestLimits, LimitExceeded
from kvindex.instance import InstanceKey
from kvindex.repair.machine import IngestState
from kvindex.wire import errors
from kvindex.wire.errors import WireError


class Instances:
    """``state_for``, for the consumer's batches and the heartbeats alike."""

    def __init__(self, shared: IngestState, limits: IngestLimits) -> None:
        self.index, self.registry, self.sequencer = shared.index, shared.registry, shared.sequencer
        self.limits, self.log = limits, shared.log

    def state_for(self, worker: str, dp_rank: int, model: str, block_size: int, epoch: int) -> InstanceState:
        """The registry entry for an instance, created on first contact; WireError on conflicts."""
        key: InstanceKey = (worker, dp_rank)
        state = self.registry.get(key)
        if state is not None and state.model == model and state.block_size == block_size:
            return state
        if state is not None and state.epoch == epoch:
            # Same process claiming another model or block size: a misconfiguration, not a restart.
            reason = errors.MODEL_MISMATCH if state.model != model else errors.BLOCK_SIZE_MISMATCH
            raise WireError(
                reason,
                f"instance {state.instance_id} announced model={model!r} block_size={block_size} "
                f"but serves model={state.model!r} block_size={state.block_size} in the same epoch",
            )
        expected = self._model_block_size(model, exclude=key)
        if expected is not None and expected != block_size:
            raise WireError(
                errors.BLOCK_SIZE_MISMATCH,
                f"model {model!r} uses block_size={expected} on its other instances, "
                f"this worker announced {block_size}; keys would never match",
            )
        self._check_room(key, model, state)
        if state is not None:
            # Restarted with another model or block size: its old blocks are meaningless now.
            self.index.drop_instance(key)
            self.registry.remove(key)
            self.sequencer.forget(key)
        self.index.add_instance(key, model)
        state = self.registry.add(key, model, block_size)
        state.epoch = epoch
        self.log.info("instance_joined", worker=worker, dp_rank=dp_rank, model=model, block_size=block_size)
        return state

    def _check_room(self, key: InstanceKey, model: str, state: InstanceState | None) -> None:
        """LimitExceeded when a new instance (or one moving to ``model``) would pass a limit."""
        limits, registry = self.limits, self.registry
        members = registry.count(model)
        if state is not None and state.model == model:
            members -= 1  # the instance itself, restarting with another block size
        if members >= limits.max_instances_per_model:
            raise LimitExceeded(
                INSTANCE_LIMIT,
                f"model {model!r} already has {members} instances (limit {limits.max_instances_per_model})",
            )
        if members == 0:
            models = len(registry.models())
            if state is not None and registry.count(state.model) == 1:
                models -= 1  # the instance leaves its old model, which then goes away
            if models >= limits.max_models:
                raise LimitExceeded(
                    MODEL_LIMIT, f"{models} models known (limit {limits.max_models}): {model!r} refused"
                )

    def _model_block_size(self, model: str, exclude: InstanceKey) -> int | None:
        # The live view, not a copy: this runs at every join, and the first or second member answers.
        for key, other in self.registry.members(model).items():
            if key != exclude:
                return other.block_size
        return None
