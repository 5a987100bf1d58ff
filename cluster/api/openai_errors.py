"""The errors of the OpenAI-compatible API: a bad field, and a model this server does not serve.

`OpenAIError` is INVALID_ARGUMENT (HTTP 400) whose `param` names the field at fault, as
OpenAI's error `param` does, and whose `code` is OpenAI's error `code` where one fits;
`ModelNotFoundError` is NOT_FOUND (HTTP 404, `model_not_found`). Both survive Ray's pickling of
a Serve replica's exceptions. `cluster.api.openai.error_response` puts them in OpenAI's shape.
"""

from __future__ import annotations

from cluster.runtime.errors import InvalidArgumentError


class OpenAIError(InvalidArgumentError):
    """A bad field: INVALID_ARGUMENT whose `param` names the field (OpenAI's error `param`)."""

    code: str | None = None
    """OpenAI's error `code`, where one fits better than none."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        # Ray pickles a Serve replica's exceptions: rebuild from both arguments.
        return (type(self), (self.message, self.param))


class ModelNotFoundError(OpenAIError):
    """The request names a model this server does not serve (NOT_FOUND, HTTP 404)."""

    status = "NOT_FOUND"
    code = "model_not_found"
