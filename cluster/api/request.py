"""A public request in domain terms (`ApiRequest`): what a caller asks of `TandemService`,
whichever face it came through.

The gRPC face reads a `tandem.v1.GenerateRequest` into one (`cluster.api.convert`); the
OpenAI-compatible face builds one straight from the JSON body (`cluster.api.openai`). Then
`cluster.api.request_reader` turns it into the router's `GenerationRequest`: tokenizing a text
or chat prompt, filling defaults, checking limits. So this type holds the caller's choices as
sent, None where the caller left a setting to the server, and checks nothing itself: every
check, and its message, is the reader's (or, for sampling settings, `SamplingParams`'s).

Plain frozen dataclasses, no protobuf, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.api.chat import Message
from cluster.api.sampling_rule import AUTO
from cluster.runtime.constraint import Grammar
from cluster.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Chat:
    """A chat prompt: messages the target's chat template renders (`cluster.api.chat`)."""

    messages: tuple[Message, ...]


Prompt = str | tuple[int, ...] | Chat | None
"""A prompt: text, token ids, or chat messages; None: the caller sent none (an error)."""


@dataclass(frozen=True)
class ApiRequest:
    """One Generate request as the caller sent it; None where it left the choice to the
    server."""

    prompt: Prompt
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Temperature, top-k and top-p; `seed_exact` is not read: `rule` says it."""
    rule: str = AUTO
    """The acceptance rule's name (`cluster.api.sampling_rule`): `auto` is the server's."""
    seed: int | None = None
    """None: a fresh random seed."""
    stop: tuple[str, ...] = ()
    draft_tokens: int | None = None
    """None: `ServiceConfig.default_draft_tokens`."""
    pipelined: bool | None = None
    """None: `ServiceConfig.default_pipelined`."""
    predraft_fan_out: int | None = None
    """None: `ServiceConfig.default_predraft_fan_out`."""
    grammar: Grammar | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
