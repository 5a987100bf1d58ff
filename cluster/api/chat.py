"""Chat messages to prompt text: the target model's chat template, applied as the model expects.

`render_chat(tokenizer, messages)` checks the messages (at least one; each role one of
`CHAT_ROLES`, or `MESSAGE_ROLES` for a message given as the template's own dict, as the OpenAI
API sends tool results and calls; each content a string) and returns what the tokenizer's chat
template makes of them with the assistant's turn opened (`add_generation_prompt=True`), as
text. The caller then tokenizes that text like any text prompt (`add_special_tokens=False`:
the template already wrote every special token the model wants, exactly as Hugging Face's own
tokenizing path does).

A tokenizer without a chat template gets `NoChatTemplateError` (FAILED_PRECONDITION: the request
is fine, this server's model cannot take it). A template that refuses the conversation (many
raise on roles that do not alternate) gets INVALID_ARGUMENT with the template's own words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cluster.runtime.errors import InvalidArgumentError, TandemError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant")
"""The roles a (role, content) chat message may have."""
MESSAGE_ROLES = (*CHAT_ROLES, "tool")
"""The roles a message given as a dict may have: a `tool` message is a call's result."""

Message = tuple[str, str] | Mapping[str, Any]
"""A (role, content) pair, or a message as the chat template takes it (`role`, `content`,
`tool_calls` with arguments as objects, `tool_call_id`)."""


class NoChatTemplateError(TandemError):
    """Chat messages were sent to a model whose tokenizer has no chat template."""

    status = "FAILED_PRECONDITION"


def check_messages(messages: Sequence[Message]) -> None:
    """Raise `InvalidArgumentError` naming the first bad message, if any."""
    if not messages:
        raise InvalidArgumentError("chat messages must not be empty")
    for i, message in enumerate(messages):
        role: object
        content: object
        roles: tuple[str, ...]
        if isinstance(message, tuple):
            (role, content), roles = message, CHAT_ROLES
        else:
            role, content, roles = message.get("role"), message.get("content"), MESSAGE_ROLES
        if role not in roles:
            raise InvalidArgumentError(
                f"messages[{i}].role must be one of {', '.join(roles)}, got {role!r}"
            )
        if not isinstance(content, str):
            raise InvalidArgumentError(
                f"messages[{i}].content must be a string, got {type(content).__name__}"
            )


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn open;
    `tools` (OpenAI's function tools) are rendered the way the template renders them."""
    check_messages(messages)
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError("the model has no chat template")
    # Imported here: jinja2 comes with transformers, which this module does not load eagerly.
    from jinja2 import TemplateError

    conversation = [
        {"role": m[0], "content": m[1]} if isinstance(m, tuple) else dict(m) for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=[dict(tool) for tool in tools] or None,
            add_generation_prompt=True,
            tokenize=False,
        )
    except TemplateError as error:
        raise InvalidArgumentError(
            f"the model's chat template refused the messages: {error}"
        ) from error
    if not isinstance(text, str):  # tokenize=False gives text; anything else is a tokenizer bug
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    return text
