"""Which top-level fields an OpenAI request body may carry, per route, and at what value.

`check_fields(route, fields)` refuses, naming the field (`OpenAIError`), any field that is
neither taken (the routes' own, `STRUCTURED_FIELDS` for `cluster.api.openai_structured`) nor
neutral. Fields OpenAI has but Tandem cannot honour (`n` > 1, `logprobs`, penalties...) are
accepted only at the value that changes nothing (`NEUTRAL`), and so are vLLM's extra parameters
that Tandem does not implement (`repetition_penalty`, `min_p`, `use_beam_search`, `bad_words`,
`truncate_prompt_tokens`...: `VLLM_NEUTRAL`); null is always accepted, as a field left out. Any
other field is unknown. Either way nothing is silently ignored that would change the output.
Pure: tables and one check; the values of the taken fields are `cluster.api.openai_schema`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cluster.api.openai_errors import OpenAIError


def _is(*values: object) -> Callable[[object], bool]:
    # `type(v) is type(x)` keeps True from passing for 1 and 0 for False.
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _is_zero(value: object) -> bool:
    return type(value) in (int, float) and value == 0


def _any_bool(value: object) -> bool:
    return isinstance(value, bool)


def _any_object(value: object) -> bool:
    return isinstance(value, dict)


def _never(value: object) -> bool:
    return False


def _is_one(value: object) -> bool:
    return type(value) in (int, float) and value == 1


STRUCTURED_FIELDS = frozenset(
    {
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
"""Fields that constrain the output or force a tool call: `cluster.api.openai_structured`
reads them."""

NEUTRAL: dict[str, dict[str, tuple[str, Callable[[object], bool]]]] = {
    "completions": {
        "best_of": ("1", _is(1)),
        "logprobs": ("null", _never),
        "echo": ("false", _is(False)),
        "suffix": ('""', _is("")),
    },
    "chat.completions": {
        "logprobs": ("false", _is(False)),
        "top_logprobs": ("0", _is(0)),
        "functions": ("[]", _is([])),
        "function_call": ('"none"', _is("none")),
        "modalities": ('["text"]', _is(["text"])),
        "store": ("false", _is(False)),
        "metadata": ("an object (nothing is stored)", _any_object),
        "audio": ("null", _never),
        "prediction": ("null", _never),
        "reasoning_effort": ("null", _never),
        "web_search_options": ("null", _never),
    },
}
"""Per route: OpenAI fields Tandem cannot honour -> (the values accepted, their test). Null is
always accepted; any other value changes the output, so it is refused."""
_NEUTRAL_COMMON: dict[str, tuple[str, Callable[[object], bool]]] = {
    "n": ("1", _is(1)),
    "presence_penalty": ("0", _is_zero),
    "frequency_penalty": ("0", _is_zero),
    "logit_bias": ("{}", _is({})),
    "service_tier": ('"auto" or "default"', _is("auto", "default")),
}
_VLLM_NEUTRAL_COMMON: dict[str, tuple[str, Callable[[object], bool]]] = {
    "use_beam_search": ("false", _is(False)),
    "best_of": ("1", _is(1)),
    "length_penalty": ("1 (there is no beam search)", _is_one),
    "min_p": ("0", _is_zero),
    "repetition_penalty": ("1", _is_one),
    "watermarking": ("false", _is(False)),
    "include_stop_str_in_output": ("false", _is(False)),
    "spaces_between_special_tokens": ("true", _is(True)),
    "truncate_prompt_tokens": ("null (prompts are never truncated)", _never),
    "truncation_side": ('"left" or "right" (prompts are never truncated)', _is("left", "right")),
    "allowed_token_ids": ("null", _never),
    "bad_words": ("[]", _is([])),
    "prompt_logprobs": ("null", _never),
    "logprob_token_ids": ("null", _never),
    "return_tokens_as_token_ids": ("true or false (there are no logprobs)", _any_bool),
    "return_token_ids": ("false", _is(False)),
    "priority": ("0", _is(0)),
    "repetition_detection": ("null", _never),
    "thinking_token_budget": ("null or -1 (no limit)", _is(-1)),
    "logits_processors": ("null", _never),
    "vllm_xargs": ("null", _never),
    "kv_transfer_params": ("null", _never),
}
VLLM_NEUTRAL: dict[str, dict[str, tuple[str, Callable[[object], bool]]]] = {
    "completions": {
        **_VLLM_NEUTRAL_COMMON,
        "add_special_tokens": ("false (prompts are tokenized without them)", _is(False)),
        "prompt_embeds": ("null", _never),
    },
    "chat.completions": {
        **_VLLM_NEUTRAL_COMMON,
        "add_special_tokens": ("false", _is(False)),
        "echo": ("false", _is(False)),
        "add_generation_prompt": ("true", _is(True)),
        "continue_final_message": ("false", _is(False)),
        "documents": ("null", _never),
        "chat_template": ("null (the model's own template is used)", _never),
        "chat_template_kwargs": ("{}", _is({})),
        "mm_processor_kwargs": ("null", _never),
    },
}
"""Per route: vLLM's extra parameters (its protocol's sampling and extra parameters) that
Tandem does not implement -> (the values accepted, their test), as `NEUTRAL`: what would change
the output, or what a client would expect of the response, is refused naming the field."""
_COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"}
    | {"stream_options", "user", "draft_tokens", "pipelined", "sampling_rule"}
    | {"ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens"}
)
_ROUTE_FIELDS: dict[str, frozenset[str]] = {
    "completions": frozenset({"prompt"}),
    "chat.completions": frozenset({"messages", "max_completion_tokens"}),
}


def check_fields(route: str, fields: Mapping[str, Any]) -> None:
    """Every field of a body for `route` is taken, or neutral at a value that changes nothing;
    else `OpenAIError` naming it."""
    neutral = {**_NEUTRAL_COMMON, **VLLM_NEUTRAL[route], **NEUTRAL[route]}
    for name, value in fields.items():
        if name in neutral:
            allowed, accepts = neutral[name]
            if value is not None and not accepts(value):
                raise OpenAIError(
                    f"{name} is not supported: only {allowed} is accepted, got {value!r}", name
                )
        elif name not in _COMMON_FIELDS | _ROUTE_FIELDS[route] | STRUCTURED_FIELDS:
            raise OpenAIError(f"unknown field {name!r} for /v1/{route.replace('.', '/')}", name)
