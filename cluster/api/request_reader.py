"""A public request (`cluster.api.request.ApiRequest`) read into the router's
`GenerationRequest`, validated (`RequestReader`).

A text prompt is tokenized with the target's tokenizer, `add_special_tokens=False`, so the ids
are exactly the text's; chat messages are rendered by the target's chat template first
(`cluster.api.chat`), and their text tokenized the same way. `TandemService` reads every request
through one reader (`TandemService.reader`), as does the OpenAI-compatible API
(`cluster.api.openai`) for the parts it checks itself.

It works on domain types only: the gRPC face reads a `GenerateRequest` into an `ApiRequest` first
(`cluster.api.convert.request_from_proto`), the OpenAI-compatible face builds one from JSON.

Validation: every bad field raises `InvalidArgumentError` (INVALID_ARGUMENT) naming the field.
Proto3 cannot tell a plain scalar's 0 from unset, so `max_tokens` 0 is an error like any value
below 1, never a silent default. `max_tokens` above `ServiceConfig.max_tokens_limit` is
INVALID_ARGUMENT too, not RESOURCE_EXHAUSTED: the limit is fixed configuration, so the same
request can never succeed on this server, while RESOURCE_EXHAUSTED tells a client to back off
and retry. Unset optional fields take defaults: `top_p` 1.0 (no nucleus cut), `seed` a fresh
random one (as generate.proto promises; send a seed to make sampling repeatable),
`draft_tokens`, `pipelined` and `predraft_fan_out` from `ServiceConfig`, `skip_special_tokens`
true. Prompt token ids are checked against the vocabulary by the verifier when the request
starts; `stop_token_ids` against the tokenizer's here (`check_stop_token_ids`). `ignore_eos`,
`min_tokens` (at most `max_tokens`) and `stop_token_ids` reach the router as they are: how each
ends a generation is `cluster.routing.output`'s.

Context limit: given the verifier replicas' `max_context_tokens` (the Serve ingress passes
`TandemConfig.verifier_limits`), a request whose prompt plus `max_tokens` exceeds it is
INVALID_ARGUMENT before anything runs, naming the limit and the largest `max_tokens` that
fits: the router keeps every pass within prompt plus `max_tokens`, so a request admitted never
meets the limit mid-stream, and one refused could never have finished. A drafter with a
smaller context only stops drafting when it is full (`cluster.routing.failover`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cluster.api.chat import Message, render_chat
from cluster.api.request import ApiRequest, Chat, Prompt
from cluster.api.sampling_rule import resolve_rule
from cluster.api.service_config import ServiceConfig
from cluster.routing.request import GenerationRequest
from cluster.runtime.constraint import Grammar, check_grammar, grammar_tokenizer_of
from cluster.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestReader:
    """Reads public requests into the router's, for one target tokenizer and configuration."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        config: ServiceConfig,
        max_context_tokens: int | None,
    ) -> None:
        """`max_context_tokens`: the verifier replicas' context limit, which prompt plus
        `max_tokens` may not exceed (None: not checked here)."""
        if max_context_tokens is not None and max_context_tokens < 1:
            raise InvalidArgumentError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        self.max_context_tokens = max_context_tokens
        self.config = config
        self._tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self._grammar_tokenizer = grammar_tokenizer_of(tokenizer, [] if eos is None else [eos])

    def grammar(self, grammar: Grammar | None) -> Grammar | None:
        """`grammar`, checked to compile for the target's tokenizer (an InvalidArgumentError
        naming `grammar.<kind>` before any work otherwise)."""
        if grammar is not None:
            check_grammar(grammar, self._grammar_tokenizer())
        return grammar

    def to_request(
        self, message: ApiRequest, deadline: float | None = None
    ) -> tuple[GenerationRequest, bool]:
        """The router's request for `message`, and whether to pipeline it; validated."""
        max_tokens = message.max_tokens
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > self.config.max_tokens_limit:
            raise InvalidArgumentError(
                f"max_tokens must be <= {self.config.max_tokens_limit} on this server, "
                f"got {max_tokens}"
            )
        seeded = message.seed is not None
        sampling = dataclasses.replace(
            message.sampling,
            seed_exact=resolve_rule(message.rule, seeded, self.config.sampling_rule),
        )
        prompt_tokens = self.prompt_tokens(message.prompt)
        if self.max_context_tokens is not None:
            check_context(len(prompt_tokens), max_tokens, self.max_context_tokens)
        request = GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            sampling=sampling,
            seed=message.seed if message.seed is not None else secrets.randbits(64),
            stop=tuple(message.stop),
            draft_tokens=(
                message.draft_tokens
                if message.draft_tokens is not None
                else self.config.default_draft_tokens
            ),
            predraft_fan_out=(
                message.predraft_fan_out
                if message.predraft_fan_out is not None
                else self.config.default_predraft_fan_out
            ),
            deadline=deadline,
            grammar=self.grammar(message.grammar),
            min_tokens=message.min_tokens,
            stop_token_ids=self.check_stop_token_ids(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
            skip_special_tokens=message.skip_special_tokens,
        )
        pipelined = (
            message.pipelined if message.pipelined is not None else self.config.default_pipelined
        )
        return request, pipelined

    def check_stop_token_ids(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """`token_ids` as a tuple, each checked to be a token of the target's tokenizer."""
        vocab_size = len(self._tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids in 0..{vocab_size - 1} (the tokenizer's "
                f"vocabulary), got {bad[0]}"
            )
        return tuple(token_ids)

    @property
    def chat_template(self) -> str | None:
        """The target tokenizer's chat template (None: it has none)."""
        template = getattr(self._tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def chat_prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """The prompt text the target's chat template makes of `messages` ((role, content)
        pairs, or the template's own dicts: tool calls and results) and
        function `tools`, ending with the assistant's turn open (`cluster.api.chat`)."""
        return render_chat(self._tokenizer, messages, tools)

    def prompt_tokens(self, prompt: Prompt) -> tuple[int, ...]:
        """`prompt` as token ids: text and rendered chat messages are tokenized with
        `add_special_tokens=False`, token ids are taken as given; validated."""
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidArgumentError("prompt text must not be empty")
            return self._encode(prompt, "prompt text")
        if isinstance(prompt, tuple):
            if not prompt:
                raise InvalidArgumentError("prompt token_ids must not be empty")
            return prompt
        if isinstance(prompt, Chat):
            return self._encode(self.chat_prompt(prompt.messages), "chat prompt")
        raise InvalidArgumentError("prompt is missing: set text or token_ids, or chat")

    def _encode(self, text: str, what: str) -> tuple[int, ...]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidArgumentError(f"{what} encodes to no tokens")
        return tuple(int(token) for token in ids)


def check_context(num_prompt_tokens: int, max_tokens: int, max_context_tokens: int) -> None:
    """Raise `InvalidArgumentError` unless the prompt plus `max_tokens` fits the context."""
    if num_prompt_tokens + max_tokens <= max_context_tokens:
        return
    exceeds = (
        f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the context "
        f"limit of {max_context_tokens} tokens"
    )
    if num_prompt_tokens >= max_context_tokens:
        raise InvalidArgumentError(
            f"{exceeds}; the prompt alone fills it: shorten the prompt so that prompt plus "
            f"max_tokens is at most {max_context_tokens}"
        )
    raise InvalidArgumentError(
        f"{exceeds}; lower max_tokens to at most {max_context_tokens - num_prompt_tokens}"
    )
