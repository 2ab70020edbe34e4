from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierBlocks(_message.Message):
    __slots__ = ("gpu", "cpu", "disk", "shared")
    GPU_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    cpu: int
    disk: int
    shared: int
    def __init__(self, gpu: _Optional[int] = ..., cpu: _Optional[int] = ..., disk: _Optional[int] = ..., shared: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "waiting_prefill_tokens", "kv_usage", "status_age_s")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    waiting_prefill_tokens: int
    kv_usage: float
    status_age_s: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_prefill_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., status_age_s: _Optional[float] = ...) -> None: ...

class PromptOptions(_message.Message):
    __slots__ = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "documents", "add_special_tokens")
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: str
    tools: str
    documents: str
    add_special_tokens: bool
    def __init__(self, add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., tools: _Optional[str] = ..., documents: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "lora", "salt", "token_ids", "block_keys", "candidates", "top_k", "policy", "explain", "role", "commit", "request_id", "prompt_tokens", "prompt", "messages", "prompt_options", "pick", "temperature", "pick_seed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PICK_SEED_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora: str
    salt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    candidates: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    policy: str
    explain: bool
    role: str
    commit: bool
    request_id: str
    prompt_tokens: int
    prompt: str
    messages: str
    prompt_options: PromptOptions
    pick: str
    temperature: float
    pick_seed: int
    def __init__(self, model: _Optional[str] = ..., lora: _Optional[str] = ..., salt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[int]] = ..., candidates: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., policy: _Optional[str] = ..., explain: _Optional[bool] = ..., role: _Optional[str] = ..., commit: _Optional[bool] = ..., request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[str] = ..., prompt_options: _Optional[_Union[PromptOptions, _Mapping]] = ..., pick: _Optional[str] = ..., temperature: _Optional[float] = ..., pick_seed: _Optional[int] = ...) -> None: ...

class RankedInstance(_message.Message):
    __slots__ = ("instance_id", "worker", "dp_rank", "cost", "matched_blocks", "matched", "matched_tokens", "load", "est_ttft_ms", "wait_ms", "prefill_ms", "fetch_ms", "matched_tokens_by_tier", "explain", "endpoint", "pick_probability")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EST_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PICK_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    worker: str
    dp_rank: int
    cost: float
    matched_blocks: int
    matched: TierBlocks
    matched_tokens: int
    load: Load
    est_ttft_ms: float
    wait_ms: float
    prefill_ms: float
    fetch_ms: float
    matched_tokens_by_tier: TierBlocks
    explain: str
    endpoint: str
    pick_probability: float
    def __init__(self, instance_id: _Optional[str] = ..., worker: _Optional[str] = ..., dp_rank: _Optional[int] = ..., cost: _Optional[float] = ..., matched_blocks: _Optional[int] = ..., matched: _Optional[_Union[TierBlocks, _Mapping]] = ..., matched_tokens: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., est_ttft_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., fetch_ms: _Optional[float] = ..., matched_tokens_by_tier: _Optional[_Union[TierBlocks, _Mapping]] = ..., explain: _Optional[str] = ..., endpoint: _Optional[str] = ..., pick_probability: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("model", "block_size", "total_blocks", "ranked", "cost_unit", "policy", "committed_instance_id", "request_id", "error", "prompt_tokens", "pick", "temperature", "pick_seed", "pick_draw", "picked_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANKED_FIELD_NUMBER: _ClassVar[int]
    COST_UNIT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PICK_SEED_FIELD_NUMBER: _ClassVar[int]
    PICK_DRAW_FIELD_NUMBER: _ClassVar[int]
    PICKED_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    total_blocks: int
    ranked: _containers.RepeatedCompositeFieldContainer[RankedInstance]
    cost_unit: str
    policy: str
    committed_instance_id: str
    request_id: str
    error: str
    prompt_tokens: int
    pick: str
    temperature: float
    pick_seed: int
    pick_draw: float
    picked_rank: int
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., ranked: _Optional[_Iterable[_Union[RankedInstance, _Mapping]]] = ..., cost_unit: _Optional[str] = ..., policy: _Optional[str] = ..., committed_instance_id: _Optional[str] = ..., request_id: _Optional[str] = ..., error: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., pick: _Optional[str] = ..., temperature: _Optional[float] = ..., pick_seed: _Optional[int] = ..., pick_draw: _Optional[float] = ..., picked_rank: _Optional[int] = ...) -> None: ...

class InstanceExplanation(_message.Message):
    __slots__ = ("instance_id", "state", "state_reason", "credit", "miss_tokens", "queued_tokens", "routed_tokens", "in_flight", "prefill_source")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    state: str
    state_reason: str
    credit: float
    miss_tokens: int
    queued_tokens: float
    routed_tokens: int
    in_flight: int
    prefill_source: str
    def __init__(self, instance_id: _Optional[str] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., credit: _Optional[float] = ..., miss_tokens: _Optional[int] = ..., queued_tokens: _Optional[float] = ..., routed_tokens: _Optional[int] = ..., in_flight: _Optional[int] = ..., prefill_source: _Optional[str] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("winner", "reason", "runner_up", "margin", "margin_ms", "deciding_term", "deciding_ms", "summary")
    WINNER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    MARGIN_MS_FIELD_NUMBER: _ClassVar[int]
    DECIDING_TERM_FIELD_NUMBER: _ClassVar[int]
    DECIDING_MS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    winner: str
    reason: str
    runner_up: str
    margin: float
    margin_ms: float
    deciding_term: str
    deciding_ms: float
    summary: str
    def __init__(self, winner: _Optional[str] = ..., reason: _Optional[str] = ..., runner_up: _Optional[str] = ..., margin: _Optional[float] = ..., margin_ms: _Optional[float] = ..., deciding_term: _Optional[str] = ..., deciding_ms: _Optional[float] = ..., summary: _Optional[str] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("ranking", "instances", "verdict")
    RANKING_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ranking: ScoreResponse
    instances: _containers.RepeatedCompositeFieldContainer[InstanceExplanation]
    verdict: Verdict
    def __init__(self, ranking: _Optional[_Union[ScoreResponse, _Mapping]] = ..., instances: _Optional[_Iterable[_Union[InstanceExplanation, _Mapping]]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "model", "lora", "salt", "token_ids", "block_keys", "prompt_tokens", "prompt", "messages", "prompt_options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    model: str
    lora: str
    salt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    prompt: str
    messages: str
    prompt_options: PromptOptions
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., model: _Optional[str] = ..., lora: _Optional[str] = ..., salt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[str] = ..., prompt_options: _Optional[_Union[PromptOptions, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    def __init__(self, committed: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "phase", "cached_tokens", "ttft_ms", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: str
    cached_tokens: int
    ttft_ms: float
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found", "report")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    report: str
    def __init__(self, found: _Optional[bool] = ..., report: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "lora", "salt", "token_ids", "block_keys", "candidates", "max_instances", "prompt", "messages", "prompt_options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora: str
    salt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    candidates: _containers.RepeatedScalarFieldContainer[str]
    max_instances: int
    prompt: str
    messages: str
    prompt_options: PromptOptions
    def __init__(self, model: _Optional[str] = ..., lora: _Optional[str] = ..., salt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[int]] = ..., candidates: _Optional[_Iterable[str]] = ..., max_instances: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[str] = ..., prompt_options: _Optional[_Union[PromptOptions, _Mapping]] = ...) -> None: ...

class InstanceMatch(_message.Message):
    __slots__ = ("instance_id", "worker", "dp_rank", "matched_blocks", "matched")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    worker: str
    dp_rank: int
    matched_blocks: int
    matched: TierBlocks
    def __init__(self, instance_id: _Optional[str] = ..., worker: _Optional[str] = ..., dp_rank: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., matched: _Optional[_Union[TierBlocks, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("model", "block_size", "total_blocks", "block_keys", "matches", "token_ids", "prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    total_blocks: int
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    matches: _containers.RepeatedCompositeFieldContainer[InstanceMatch]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_keys: _Optional[_Iterable[int]] = ..., matches: _Optional[_Iterable[_Union[InstanceMatch, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("model", "page_size", "page_token", "view")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    model: str
    page_size: int
    page_token: str
    view: str
    def __init__(self, model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., view: _Optional[str] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "worker", "dp_rank", "model", "block_size", "epoch", "last_seq", "load", "blocks", "capacity", "batches", "gaps", "missing_batches", "restarts", "pool", "stale", "sync", "endpoint", "approximate", "state", "state_reason", "outcomes_exact", "outcomes_over", "outcomes_under", "role", "pd_group", "kv_groups", "prefill")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    MISSING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_EXACT_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_OVER_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_UNDER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PD_GROUP_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    worker: str
    dp_rank: int
    model: str
    block_size: int
    epoch: int
    last_seq: int
    load: Load
    blocks: TierBlocks
    capacity: TierBlocks
    batches: int
    gaps: int
    missing_batches: int
    restarts: int
    pool: bool
    stale: bool
    sync: str
    endpoint: str
    approximate: bool
    state: str
    state_reason: str
    outcomes_exact: int
    outcomes_over: int
    outcomes_under: int
    role: str
    pd_group: str
    kv_groups: str
    prefill: PrefillFit
    def __init__(self, instance_id: _Optional[str] = ..., worker: _Optional[str] = ..., dp_rank: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., blocks: _Optional[_Union[TierBlocks, _Mapping]] = ..., capacity: _Optional[_Union[TierBlocks, _Mapping]] = ..., batches: _Optional[int] = ..., gaps: _Optional[int] = ..., missing_batches: _Optional[int] = ..., restarts: _Optional[int] = ..., pool: _Optional[bool] = ..., stale: _Optional[bool] = ..., sync: _Optional[str] = ..., endpoint: _Optional[str] = ..., approximate: _Optional[bool] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., outcomes_exact: _Optional[int] = ..., outcomes_over: _Optional[int] = ..., outcomes_under: _Optional[int] = ..., role: _Optional[str] = ..., pd_group: _Optional[str] = ..., kv_groups: _Optional[str] = ..., prefill: _Optional[_Union[PrefillFit, _Mapping]] = ...) -> None: ...

class PrefillFit(_message.Message):
    __slots__ = ("source", "a_ms", "b_ms_per_token", "c_ms_per_token2", "samples", "error", "has_error")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    A_MS_FIELD_NUMBER: _ClassVar[int]
    B_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    C_MS_PER_TOKEN2_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HAS_ERROR_FIELD_NUMBER: _ClassVar[int]
    source: str
    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float
    samples: int
    error: float
    has_error: bool
    def __init__(self, source: _Optional[str] = ..., a_ms: _Optional[float] = ..., b_ms_per_token: _Optional[float] = ..., c_ms_per_token2: _Optional[float] = ..., samples: _Optional[int] = ..., error: _Optional[float] = ..., has_error: _Optional[bool] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "next_page_token")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    next_page_token: str
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("models", "instances", "distinct_blocks", "entries", "batches_received", "batches_applied", "batches_duplicate", "batches_stale_epoch", "gaps", "missing_batches", "restarts", "status_received", "events_stored", "events_removed", "events_cleared", "rejects_total", "rejects_by_reason", "replays_requested", "replays_ok", "replays_failed", "snapshots_requested", "snapshots_applied", "reconciled_blocks_added", "reconciled_blocks_removed", "drift_detected", "repairs_converged", "convergence_seconds_max", "instances_stale", "index_bytes")
    class RejectsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReplaysFailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SnapshotsRequestedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODELS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_STALE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    MISSING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_STORED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    REJECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_OK_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    RECONCILED_BLOCKS_ADDED_FIELD_NUMBER: _ClassVar[int]
    RECONCILED_BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    DRIFT_DETECTED_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_CONVERGED_FIELD_NUMBER: _ClassVar[int]
    CONVERGENCE_SECONDS_MAX_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_STALE_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    models: int
    instances: int
    distinct_blocks: TierBlocks
    entries: TierBlocks
    batches_received: int
    batches_applied: int
    batches_duplicate: int
    batches_stale_epoch: int
    gaps: int
    missing_batches: int
    restarts: int
    status_received: int
    events_stored: int
    events_removed: int
    events_cleared: int
    rejects_total: int
    rejects_by_reason: _containers.ScalarMap[str, int]
    replays_requested: int
    replays_ok: int
    replays_failed: _containers.ScalarMap[str, int]
    snapshots_requested: _containers.ScalarMap[str, int]
    snapshots_applied: int
    reconciled_blocks_added: int
    reconciled_blocks_removed: int
    drift_detected: int
    repairs_converged: int
    convergence_seconds_max: float
    instances_stale: int
    index_bytes: int
    def __init__(self, models: _Optional[int] = ..., instances: _Optional[int] = ..., distinct_blocks: _Optional[_Union[TierBlocks, _Mapping]] = ..., entries: _Optional[_Union[TierBlocks, _Mapping]] = ..., batches_received: _Optional[int] = ..., batches_applied: _Optional[int] = ..., batches_duplicate: _Optional[int] = ..., batches_stale_epoch: _Optional[int] = ..., gaps: _Optional[int] = ..., missing_batches: _Optional[int] = ..., restarts: _Optional[int] = ..., status_received: _Optional[int] = ..., events_stored: _Optional[int] = ..., events_removed: _Optional[int] = ..., events_cleared: _Optional[int] = ..., rejects_total: _Optional[int] = ..., rejects_by_reason: _Optional[_Mapping[str, int]] = ..., replays_requested: _Optional[int] = ..., replays_ok: _Optional[int] = ..., replays_failed: _Optional[_Mapping[str, int]] = ..., snapshots_requested: _Optional[_Mapping[str, int]] = ..., snapshots_applied: _Optional[int] = ..., reconciled_blocks_added: _Optional[int] = ..., reconciled_blocks_removed: _Optional[int] = ..., drift_detected: _Optional[int] = ..., repairs_converged: _Optional[int] = ..., convergence_seconds_max: _Optional[float] = ..., instances_stale: _Optional[int] = ..., index_bytes: _Optional[int] = ...) -> None: ...
