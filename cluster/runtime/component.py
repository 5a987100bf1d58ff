"""What drafter and verifier both are: a model's sessions on a batching engine, and the calls on
them.

`SessionComponent` builds the replica's model runner (a paged KV pool, `cluster.runtime.runner`)
and its `Engine` (`cluster.runtime.engine`), holds the `SessionTable`
(`cluster.runtime.session`) and serves the session calls both sides share (open, close, evict,
stats). Each call is a task the engine thread runs, so calls from any number of threads are
safe and the table has one writer; every forward pass a task needs joins the engine's next
batched step. Each side adds its own call (`draft`, `verify`) the same way and may derive the
sampling and seed a session keeps (`_session_sampling`). A plain class: no Ray, no gRPC.

Every call comes in two forms: `submit_*` hands the task to the engine and returns a future at
once (what a Frames stream uses, `cluster.replica.frames`: many calls in flight from one
thread), and the blocking method waits on it. An error raised before the engine takes the task
(a constraint this model cannot follow, a stopped engine) comes back as a failed future, never
raised by `submit_*`, so a caller has one place to look for every outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Generic, TypeVar

import torch
from llguidance import LLTokenizer

from cluster.runtime.block_runner import ModelRunner
from cluster.runtime.constraint import GRAMMAR_TOKENIZERS, Constraint, TokenMatcher
from cluster.runtime.engine import Engine
from cluster.runtime.errors import ResourceExhaustedError
from cluster.runtime.limits import (
    DEFAULT_MAX_STEP_SEQUENCES,
    DEFAULT_MAX_STEP_TOKENS,
    MAX_BLOCK_TOKENS,
    SessionLimits,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.runner import build_runner
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaSession, ReplicaStats, SessionTable
from cluster.runtime.task import Forward, Preempted, Task

C = TypeVar("C", bound=SessionLimits)
R = TypeVar("R")


def submitted(submit: Callable[[], Future[R]]) -> Future[R]:
    """`submit()`, or a future failed with what it raised: an error before the engine takes
    a task reaches the caller where every later one does."""
    try:
        return submit()
    except Exception as error:
        failed: Future[R] = Future()
        failed.set_exception(error)
        return failed


def _budget(configured: int | None, runner: ModelRunner, name: str) -> int:
    """A step budget: the config's, else the device's own (a simulated GPU's profile), else
    the default for the host's cores."""
    if configured is not None:
        return configured
    own: int | None = getattr(runner, name, None)
    if own is not None:
        return own
    return DEFAULT_MAX_STEP_TOKENS if name == "max_step_tokens" else DEFAULT_MAX_STEP_SEQUENCES


class SessionComponent(Generic[C]):
    """What drafter and verifier both are: sessions on one model, served by one engine, with
    the calls on them both serve."""

    def __init__(self, model: LoadedModel, config: C, runner: ModelRunner | None = None) -> None:
        """`runner`: the model runner to use (default: built for `model` from `config`)."""
        self.config = config
        self._model = model
        if runner is None:
            runner = build_runner(
                model,
                kv_cache_bytes=config.kv_cache_bytes,
                kv_cache_fraction=config.kv_cache_fraction,
                max_tokens_needed=config.max_sessions * config.max_context_tokens,
                max_sequence_tokens=config.max_context_tokens,
                block_size=config.kv_block_size,
            )
        self._runner = runner
        self._engine = Engine(
            runner,
            max_step_tokens=_budget(config.max_step_tokens, runner, "max_step_tokens"),
            max_step_sequences=_budget(config.max_step_sequences, runner, "max_step_sequences"),
            gather_share=config.gather_share,
            name=f"{type(self).__name__.lower()}-engine",
        )
        self._engine.calibrate()
        self._sessions = SessionTable(
            model,
            runner,
            config.max_sessions,
            config.max_context_tokens,
            config.session_ttl_s,
            kv_overcommit=config.kv_overcommit,
        )

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer over this side's vocabulary (built on
        the first call; a replica starts that build at once: `constraint.warm_up`)."""
        model = self._model
        return GRAMMAR_TOKENIZERS.get(model.tokenizer, self.vocab_size, model.eos_token_ids)

    @property
    def engine(self) -> Engine:
        return self._engine

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
    ) -> int:
        """Open a session and prefill its cache; returns the committed length.

        `time_limit_s`: seconds the request has left; once they pass the session is dropped
        and a call on it raises `DeadlineExceededError` (None: only the idle TTL applies).
        `max_new_tokens`: how far the session may grow past its prompt, for admission (None:
        a block and its bonus). Refused with RESOURCE_EXHAUSTED (and a retry hint) when the KV
        pool could never hold the prompt or the planned growth fits no more
        (`SessionLimits.kv_overcommit`), unless `resumed` (the request already runs elsewhere:
        a refusal would fail it midway); a prompt that fits once other sessions free blocks
        waits for them. `constraint`: what the generated tokens must follow (None: anything);
        its matcher is built here, in the caller's thread, and advanced along the tokens of
        `prompt_tokens` past `constraint.prompt_length` (generated before a failover)."""
        return self.submit_open(
            session_id,
            prompt_tokens,
            sampling,
            seed,
            time_limit_s=time_limit_s,
            max_new_tokens=max_new_tokens,
            resumed=resumed,
            constraint=constraint,
        ).result()

    def submit_open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
        max_new_tokens: int | None = None,
        resumed: bool = False,
        constraint: Constraint | None = None,
        on_open: Callable[[str, ReplicaSession], None] | None = None,
    ) -> Future[int]:
        """`open_session` without waiting: a future of the committed length. `on_open(id,
        session)`: called on the engine thread once the session is open and prefilled (how a
        side sets up what it keeps beside it)."""

        def submit() -> Future[int]:
            if not resumed:
                self._check_in_time(time_limit_s)
            matcher = self._matcher(constraint, prompt_tokens)
            task = self._open(
                session_id,
                tuple(prompt_tokens),
                sampling,
                seed,
                time_limit_s,
                max_new_tokens,
                resumed,
                (constraint is not None and constraint.active, matcher),
                on_open,
            )
            return self._engine.submit(task, key=session_id)

        return submitted(submit)

    def _check_in_time(self, time_limit_s: float | None) -> None:
        """Refuse a new session whose request has less time left than the engine's queue is
        expected to keep it waiting: RESOURCE_EXHAUSTED with that wait as the retry hint,
        rather than a session that would pass its deadline before its prefill ran."""
        wait = self._engine.expected_wait_s()
        if time_limit_s is None or wait < time_limit_s:
            return
        self._sessions.num_refused += 1
        raise ResourceExhaustedError(
            f"the replica's queue keeps a call waiting about {wait:.3g} s and the request "
            f"has {time_limit_s:.3g} s left; retry after {wait:.3g} s or on another replica",
            retry_after_s=wait,
        )

    def _matcher(
        self, constraint: Constraint | None, prompt_tokens: Sequence[int]
    ) -> TokenMatcher | None:
        """The session's matcher, standing after its generated tokens; None when unconstrained.
        InvalidArgumentError for a constraint this model cannot follow (the drafter then
        drafts nothing instead: `Drafter._matcher`)."""
        if constraint is None or not constraint.active:
            return None
        tokenizer = self.grammar_tokenizer() if constraint.grammar is not None else None
        matcher = TokenMatcher(constraint, tokenizer, self.vocab_size)
        matcher.sync(prompt_tokens[constraint.prompt_length :])
        return matcher

    def _open(
        self,
        session_id: str,
        prompt_tokens: tuple[int, ...],
        sampling: SamplingParams,
        seed: int,
        time_limit_s: float | None,
        max_new_tokens: int | None,
        resumed: bool,
        constrained: tuple[bool, TokenMatcher | None],
        on_open: Callable[[str, ReplicaSession], None] | None = None,
    ) -> Task[int]:
        own_sampling, own_seed = self._session_sampling(sampling, seed)
        session = self._sessions.open(
            session_id,
            prompt_tokens,
            own_sampling,
            own_seed,
            time_limit_s,
            headroom_tokens=self._headroom_tokens(),
            max_new_tokens=max_new_tokens,
            resumed=resumed,
        )
        session.constrained, session.matcher = constrained
        # The last committed token is fed with the next forward, whose logits need it.
        try:
            yield from self._forward(session, 0, upto=len(prompt_tokens) - 1)
        except BaseException:
            self._sessions.remove(session_id)
            raise
        if on_open is not None:
            on_open(session_id, session)
        return session.committed_length

    def _headroom_tokens(self) -> int:
        """Tokens past the prompt a new session must find room for: a block and its bonus."""
        return MAX_BLOCK_TOKENS + 1

    def _forward(
        self, session: ReplicaSession, num_logits: int, upto: int | None = None
    ) -> Task[torch.Tensor | None]:
        """Run what the session's KV lacks of its sequence's first `upto` tokens (default: all)
        in the engine's next steps; returns the logits at the last `num_logits` of them
        (float32 `[num_logits, vocab]`; None when nothing had to run). Preemptible: if the
        engine frees the session's blocks meanwhile, the work is planned again (recomputed)."""
        logits: torch.Tensor | None = yield from self._run(session, num_logits, upto, False)
        return logits

    def _argmaxes(self, session: ReplicaSession, num_logits: int) -> Task[list[int] | None]:
        """`_forward` for a greedy choice: each of those rows' argmax (None when nothing had
        to run); `InvalidArgumentError` when a row has no finite maximum."""
        best: list[int] | None = yield from self._run(session, num_logits, None, True)
        return best

    def _run(
        self, session: ReplicaSession, num_logits: int, upto: int | None, greedy: bool
    ) -> Task[Any]:
        while True:
            work = session.kv.work(num_logits, upto)
            if work is None:
                return None
            try:
                return (yield Forward(work, preemptible=True, greedy=greedy))
            except Preempted:
                continue  # its blocks went to an older session: recompute what the KV lost

    def _session_sampling(self, sampling: SamplingParams, seed: int) -> tuple[SamplingParams, int]:
        """The sampling settings and seed a new session keeps: the request's, unless a side
        derives its own."""
        return sampling, seed

    def close_session(self, session_id: str) -> bool:
        """Free the session and its KV blocks (after a call on it still running); True if it
        existed."""
        return self.submit_close(session_id).result()

    def submit_close(self, session_id: str) -> Future[bool]:
        """`close_session` without waiting: a future of whether the session existed."""
        return submitted(
            lambda: self._engine.submit_call(
                lambda: self._sessions.remove(session_id), key=session_id, closes=True
            )
        )

    def evict_idle(self) -> int:
        """Evict the sessions past their time limit or idle past the TTL (the replica host
        calls this every second), but none with a call running; returns how many went."""
        return self._engine.call(lambda: self._sessions.evict_idle(busy=self._engine.active_keys))

    def stats(self) -> ReplicaStats:
        engine = self._engine.stats()
        engine = replace(engine, refusals=engine.refusals + self._sessions.num_refused)
        return self._sessions.stats(busy_s=self._engine.counters.busy_s, engine=engine)

    @property
    def alive(self) -> bool:
        """Whether the engine takes calls (a replica whose engine died serves nothing)."""
        return self._engine.alive

    def close(self) -> None:
        """Stop the engine (calls still waiting fail); the component serves nothing after."""
        self._engine.stop()
