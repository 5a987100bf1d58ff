from protos import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculationSettings(_message.Message):
    __slots__ = ("draft_tokens", "pipelined", "predraft_fan_out")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_FAN_OUT_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    pipelined: bool
    predraft_fan_out: int
    def __init__(self, draft_tokens: _Optional[int] = ..., pipelined: _Optional[bool] = ..., predraft_fan_out: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_tokens", "sampling", "seed", "stop", "speculation", "grammar", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    max_tokens: int
    sampling: _sampling_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationSettings
    grammar: _sampling_pb2.Grammar
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationSettings, _Mapping]] = ..., grammar: _Optional[_Union[_sampling_pb2.Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("num_drafted", "num_accepted", "num_verify_passes", "pipeline_hits", "pipeline_misses", "drafted_by_position", "accepted_by_position", "predraft_hits", "predraft_misses", "suffix_drafted", "suffix_accepted", "model_drafted", "model_accepted", "draft_mode", "draft_mode_reason")
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_PASSES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_MISSES_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    num_drafted: int
    num_accepted: int
    num_verify_passes: int
    pipeline_hits: int
    pipeline_misses: int
    drafted_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    predraft_hits: int
    predraft_misses: int
    suffix_drafted: int
    suffix_accepted: int
    model_drafted: int
    model_accepted: int
    draft_mode: str
    draft_mode_reason: str
    def __init__(self, num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_verify_passes: _Optional[int] = ..., pipeline_hits: _Optional[int] = ..., pipeline_misses: _Optional[int] = ..., drafted_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., predraft_hits: _Optional[int] = ..., predraft_misses: _Optional[int] = ..., suffix_drafted: _Optional[int] = ..., suffix_accepted: _Optional[int] = ..., model_drafted: _Optional[int] = ..., model_accepted: _Optional[int] = ..., draft_mode: _Optional[str] = ..., draft_mode_reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationStats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationStats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "requests", "prompt_tokens", "generated_tokens", "drafted_tokens", "accepted_tokens", "refused", "running")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    refused: int
    running: int
    def __init__(self, tenant: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., refused: _Optional[int] = ..., running: _Optional[int] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("request", "dtype")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    dtype: str
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., dtype: _Optional[str] = ...) -> None: ...

class AuditResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "matched", "total", "first_divergence", "gap", "served_token", "reference_token", "rule", "drafter", "dtype", "cause", "served_gap", "worst_gap")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SERVED_GAP_FIELD_NUMBER: _ClassVar[int]
    WORST_GAP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    matched: int
    total: int
    first_divergence: int
    gap: float
    served_token: int
    reference_token: int
    rule: str
    drafter: str
    dtype: str
    cause: str
    served_gap: float
    worst_gap: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., matched: _Optional[int] = ..., total: _Optional[int] = ..., first_divergence: _Optional[int] = ..., gap: _Optional[float] = ..., served_token: _Optional[int] = ..., reference_token: _Optional[int] = ..., rule: _Optional[str] = ..., drafter: _Optional[str] = ..., dtype: _Optional[str] = ..., cause: _Optional[str] = ..., served_gap: _Optional[float] = ..., worst_gap: _Optional[float] = ...) -> None: ...
