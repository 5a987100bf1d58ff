"""Hostile HTTP bodies, hundreds of times: the OpenAI-compatible API over the in-process service
answers every body with a 4xx that names the problem or a well-formed answer, never a 5xx.

`OpenAIHttp` is driven as Serve drives it (tests/cluster/serve/test_openai_http.py's `Exchange`),
over a real `OpenAIService` on the in-process tiny pair, so a body that passes every check is
really generated. Bodies are built from the API's own fields, each set to a plausible value or
to any JSON value (deep, huge, NaN, lone UTF-16 surrogates...), plus unknown keys, sent to both
routes, streamed or not, and to `POST /v1/audit` (whose answers must find no divergence).
The bodies sent per route and the answers per status are printed (`pytest -s`) for the record.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.api.openai import OpenAIService
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.status import INTERNAL_ERROR_MESSAGE
from cluster.api.tenants import Tenants
from cluster.local import LocalTandem
from cluster.serve.http import OpenAIHttp
from tests.cluster.serve.test_openai_http import events, exchange

MODEL = "tiny"
EXAMPLES = 400  # per route
MAX_TOKENS_LIMIT = 8  # keeps a generated answer to a few steps of the tiny pair
STATUSES: Counter[int] = Counter()
BODIES: Counter[str] = Counter()  # per route

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "ok \udc4b"])
TEXT = st.text(max_size=24) | SURROGATES
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]) | ANY_JSON,
     "content": TEXT | ANY_JSON},
    optional={"name": ANY_JSON, "tool_calls": ANY_JSON},
)  # fmt: skip
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | TEXT,
    "prompt": TEXT | st.lists(st.integers(-3, 300), max_size=8) | st.lists(TEXT, max_size=3),
    "messages": st.lists(MESSAGE, max_size=3),
    "max_tokens": st.integers(-2, MAX_TOKENS_LIMIT + 2),
    "max_completion_tokens": st.integers(-2, MAX_TOKENS_LIMIT + 2),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 70),
    "seed": st.integers(-2, 2**65),
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": ANY_JSON}),
    "user": TEXT,
    "draft_tokens": st.integers(-2, 40),
    "pipelined": st.booleans(),
    "n": st.integers(0, 3),
    "logprobs": ANY_JSON,
    "presence_penalty": st.floats(-1, 1),
}

AUDIT_PLAUSIBLE = {"audit_dtype": st.sampled_from(["", "float32", "bfloat16"])}
"""`POST /v1/audit`'s own field, beside the completions fields."""


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """A request body for `path`: a valid one, then some of the API's fields set to a plausible
    value (3 in 4) or anything, maybe an unknown key, now and then not even an object."""
    if path.endswith("chat/completions"):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"model": MODEL, "prompt": "def add(a, b):"}
    body["max_tokens"] = draw(st.integers(1, MAX_TOKENS_LIMIT))
    if path.endswith("audit"):
        body["seed"] = draw(st.integers(0, 1000))  # seed-exact: replayable unless changed
    plausible = {**PLAUSIBLE, **(AUDIT_PLAUSIBLE if path.endswith("audit") else {})}
    fields = draw(st.lists(st.sampled_from(sorted(plausible)), unique=True, max_size=5))
    for name in fields:
        anything = draw(st.integers(0, 3)) == 0
        body[name] = draw(ANY_JSON if anything else plausible[name])
    if draw(st.integers(0, 4)) == 0:
        body.update(draw(st.dictionaries(TEXT, ANY_JSON, min_size=1, max_size=2)))
    value: object = body if draw(st.integers(0, 19)) else draw(ANY_JSON)
    return json.dumps(value, allow_nan=True).encode()


@pytest.fixture(scope="module")
def adapter(local_tandem: LocalTandem) -> Iterator[OpenAIHttp]:
    service = TandemService(
        local_tandem.router,
        local_tandem.tokenizer,
        ServiceConfig(max_tokens_limit=MAX_TOKENS_LIMIT),
        tenants=Tenants.unauthenticated(),
    )
    threads = ThreadPoolExecutor(4, thread_name_prefix="fuzz-http")
    yield OpenAIHttp(OpenAIService(service, MODEL), threads)
    threads.shutdown()
    print(
        f"\nHTTP fuzz: {sum(BODIES.values())} bodies, per route {dict(BODIES)}; "
        f"statuses: {dict(sorted(STATUSES.items()))}"
    )


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/audit"])
@FUZZ
@given(data=st.data())
def test_every_body_gets_a_precise_answer(
    adapter: OpenAIHttp, path: str, data: st.DataObject
) -> None:
    body = data.draw(bodies(path))
    BODIES[path] += 1
    done = exchange(adapter, "POST", path, body)
    STATUSES[done.status] += 1
    assert done.status < 500, (body[:300], done.content[:300])
    if done.status != 200:
        error = done.json()["error"]
        assert error["message"] and error["message"] != INTERNAL_ERROR_MESSAGE
        return
    if done.headers["content-type"].startswith("text/event-stream"):
        for event in events(done.content):
            if event != b"[DONE]":
                chunk = json.loads(event)
                assert chunk.get("error", {}).get("message") != INTERNAL_ERROR_MESSAGE, chunk
        return
    answer = done.json()
    if path == "/v1/audit":  # and the audit of a healthy service finds nothing
        assert answer["total"] == len(answer["token_ids"]) <= MAX_TOKENS_LIMIT
        assert answer["cause"] != "divergence", answer
        return
    assert answer["choices"] and answer["usage"]["completion_tokens"] <= MAX_TOKENS_LIMIT
