from protos import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouterFrame(_message.Message):
    __slots__ = ("version", "entries")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    version: int
    entries: _containers.RepeatedCompositeFieldContainer[FrameEntry]
    def __init__(self, version: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[FrameEntry, _Mapping]]] = ...) -> None: ...

class FrameEntry(_message.Message):
    __slots__ = ("tag", "open", "draft", "verify", "close", "cancel", "predraft")
    TAG_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    open: OpenSessionRequest
    draft: DraftRequest
    verify: VerifyRequest
    close: CloseSessionRequest
    cancel: CancelEntry
    predraft: PredraftRequest
    def __init__(self, tag: _Optional[int] = ..., open: _Optional[_Union[OpenSessionRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSessionRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelEntry, _Mapping]] = ..., predraft: _Optional[_Union[PredraftRequest, _Mapping]] = ...) -> None: ...

class CancelEntry(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: int
    def __init__(self, tag: _Optional[int] = ...) -> None: ...

class ReplicaFrame(_message.Message):
    __slots__ = ("version", "results")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    results: _containers.RepeatedCompositeFieldContainer[FrameResult]
    def __init__(self, version: _Optional[int] = ..., results: _Optional[_Iterable[_Union[FrameResult, _Mapping]]] = ...) -> None: ...

class FrameResult(_message.Message):
    __slots__ = ("tag", "opened", "block", "verdict", "closed", "error", "predrafted")
    TAG_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    tag: int
    opened: OpenSessionResponse
    block: DraftBlock
    verdict: Verdict
    closed: CloseSessionResponse
    error: EntryError
    predrafted: PredraftResponse
    def __init__(self, tag: _Optional[int] = ..., opened: _Optional[_Union[OpenSessionResponse, _Mapping]] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., closed: _Optional[_Union[CloseSessionResponse, _Mapping]] = ..., error: _Optional[_Union[EntryError, _Mapping]] = ..., predrafted: _Optional[_Union[PredraftResponse, _Mapping]] = ...) -> None: ...

class EntryError(_message.Message):
    __slots__ = ("status", "message", "retry_after_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    status: str
    message: str
    retry_after_ms: int
    def __init__(self, status: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "seed", "time_limit_ms", "max_new_tokens", "resumed", "grammar", "min_tokens", "end_token_ids", "prompt_length", "tenant", "advance")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    seed: int
    time_limit_ms: int
    max_new_tokens: int
    resumed: bool
    grammar: _sampling_pb2.Grammar
    min_tokens: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    tenant: str
    advance: Advance
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., time_limit_ms: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., resumed: _Optional[bool] = ..., grammar: _Optional[_Union[_sampling_pb2.Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., tenant: _Optional[str] = ..., advance: _Optional[_Union[Advance, _Mapping]] = ...) -> None: ...

class Advance(_message.Message):
    __slots__ = ("max_length", "end_token_ids", "ends_from")
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FROM_FIELD_NUMBER: _ClassVar[int]
    max_length: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ends_from: int
    def __init__(self, max_length: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., ends_from: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("committed_length",)
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    def __init__(self, committed_length: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "base_length", "appended_token_ids", "num_tokens", "truncate_to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_length: int
    appended_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    truncate_to: int
    def __init__(self, session_id: _Optional[str] = ..., base_length: _Optional[int] = ..., appended_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., truncate_to: _Optional[int] = ...) -> None: ...

class PredraftRequest(_message.Message):
    __slots__ = ("session_id", "base_length", "appended_token_ids", "truncate_to", "block_token_ids", "branches", "num_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_length: int
    appended_token_ids: _containers.RepeatedScalarFieldContainer[int]
    truncate_to: int
    block_token_ids: _containers.RepeatedScalarFieldContainer[int]
    branches: _containers.RepeatedCompositeFieldContainer[PredraftBranch]
    num_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., base_length: _Optional[int] = ..., appended_token_ids: _Optional[_Iterable[int]] = ..., truncate_to: _Optional[int] = ..., block_token_ids: _Optional[_Iterable[int]] = ..., branches: _Optional[_Iterable[_Union[PredraftBranch, _Mapping]]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PredraftBranch(_message.Message):
    __slots__ = ("accepted", "rank")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rank: int
    def __init__(self, accepted: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class PredraftResponse(_message.Message):
    __slots__ = ("branches",)
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[PreDraft]
    def __init__(self, branches: _Optional[_Iterable[_Union[PreDraft, _Mapping]]] = ...) -> None: ...

class PreDraft(_message.Message):
    __slots__ = ("accepted", "token", "token_ids", "draft_probs", "load")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    load: StepLoad
    def __init__(self, accepted: _Optional[int] = ..., token: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., load: _Optional[_Union[StepLoad, _Mapping]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    probs: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("base_length", "token_ids", "draft_probs", "load", "assumed_token_ids")
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    base_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    load: StepLoad
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, base_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., load: _Optional[_Union[StepLoad, _Mapping]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepLoad(_message.Message):
    __slots__ = ("batch_sequences", "batch_tokens", "cost_base_s", "cost_per_token_s")
    BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    batch_sequences: int
    batch_tokens: int
    cost_base_s: float
    cost_per_token_s: float
    def __init__(self, batch_sequences: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., cost_base_s: _Optional[float] = ..., cost_per_token_s: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "block", "defer_bonus")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DEFER_BONUS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block: DraftBlock
    defer_bonus: bool
    def __init__(self, session_id: _Optional[str] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ..., defer_bonus: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("base_length", "num_accepted", "token_ids", "committed_length", "bonus_deferred", "load", "num_matched", "dropped")
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BONUS_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    base_length: int
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    bonus_deferred: bool
    load: StepLoad
    num_matched: int
    dropped: bool
    def __init__(self, base_length: _Optional[int] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., bonus_deferred: _Optional[bool] = ..., load: _Optional[_Union[StepLoad, _Mapping]] = ..., num_matched: _Optional[int] = ..., dropped: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("num_sessions", "num_cached_tokens", "busy_s", "engine", "frames_sent", "results_sent", "frames_received", "entries_received", "sessions_expired", "sessions_evicted")
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_SENT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_SENT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_sessions: int
    num_cached_tokens: int
    busy_s: float
    engine: EngineStats
    frames_sent: int
    results_sent: int
    frames_received: int
    entries_received: int
    sessions_expired: int
    sessions_evicted: int
    def __init__(self, num_sessions: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., engine: _Optional[_Union[EngineStats, _Mapping]] = ..., frames_sent: _Optional[int] = ..., results_sent: _Optional[int] = ..., frames_received: _Optional[int] = ..., entries_received: _Optional[int] = ..., sessions_expired: _Optional[int] = ..., sessions_evicted: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("runner", "steps", "max_batch_sequences", "kv_blocks_total", "kv_blocks_used", "block_size", "batch_sequences", "step_tokens", "queue_wait_s", "queued", "cost_base_s", "cost_per_token_s", "busy_s", "forward_s", "device_s", "batched_s", "gather_s", "gathers", "preemptions", "recomputed_tokens", "refusals", "running_sessions", "running_stepped", "startup_base_s", "startup_per_token_s", "step_running_s")
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    BATCHED_S_FIELD_NUMBER: _ClassVar[int]
    GATHER_S_FIELD_NUMBER: _ClassVar[int]
    GATHERS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_STEPPED_FIELD_NUMBER: _ClassVar[int]
    STARTUP_BASE_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_RUNNING_S_FIELD_NUMBER: _ClassVar[int]
    runner: str
    steps: int
    max_batch_sequences: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    batch_sequences: float
    step_tokens: float
    queue_wait_s: float
    queued: int
    cost_base_s: float
    cost_per_token_s: float
    busy_s: float
    forward_s: float
    device_s: float
    batched_s: float
    gather_s: float
    gathers: int
    preemptions: int
    recomputed_tokens: int
    refusals: int
    running_sessions: int
    running_stepped: int
    startup_base_s: float
    startup_per_token_s: float
    step_running_s: float
    def __init__(self, runner: _Optional[str] = ..., steps: _Optional[int] = ..., max_batch_sequences: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., batch_sequences: _Optional[float] = ..., step_tokens: _Optional[float] = ..., queue_wait_s: _Optional[float] = ..., queued: _Optional[int] = ..., cost_base_s: _Optional[float] = ..., cost_per_token_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., device_s: _Optional[float] = ..., batched_s: _Optional[float] = ..., gather_s: _Optional[float] = ..., gathers: _Optional[int] = ..., preemptions: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., refusals: _Optional[int] = ..., running_sessions: _Optional[int] = ..., running_stepped: _Optional[int] = ..., startup_base_s: _Optional[float] = ..., startup_per_token_s: _Optional[float] = ..., step_running_s: _Optional[float] = ...) -> None: ...

class ReferenceRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "served_token_ids", "sampling", "seed", "dtype")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    served_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    seed: int
    dtype: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., served_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReferenceResponse(_message.Message):
    __slots__ = ("token_ids", "gaps", "dtype", "served_gaps")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SERVED_GAPS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    gaps: bytes
    dtype: str
    served_gaps: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., gaps: _Optional[bytes] = ..., dtype: _Optional[str] = ..., served_gaps: _Optional[bytes] = ...) -> None: ...
