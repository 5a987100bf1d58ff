"""Drafter and verifier on their batching engines, with many sessions at once: the output is
the unbatched output and Hugging Face `generate`'s, token for token (greedy, fp32); a seeded
request samples the same tokens alone and batched; KV blocks come back after a burst; a pool
that is too small refuses with RESOURCE_EXHAUSTED and keeps serving the rest.

Sessions run on threads against one `Drafter` and one `Verifier` (as the gRPC handlers call
them), so the engines really batch: the tests check the engines' `max_batch_sequences`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.engine import Engine
from cluster.runtime.errors import ResourceExhaustedError
from cluster.runtime.model_spec import TINY_DRAFT, TINY_TARGET, ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40)
NEW_TOKENS = 24


def load(name: str) -> LoadedModel:
    return load_model(ModelSpec(name, device="cpu"))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Drafter, Verifier]]:
    drafter = Drafter(load(TINY_DRAFT), DrafterConfig(kv_cache_bytes=32 << 20))
    verifier = Verifier(load(TINY_TARGET), VerifierConfig(kv_cache_bytes=32 << 20))
    yield drafter, verifier
    drafter.close()
    verifier.close()


@pytest.fixture(scope="module")
def reference_model() -> LoadedModel:
    return load(TINY_TARGET)


def hf_greedy(model: LoadedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy (it stops early at EOS)."""
    with torch.inference_mode():
        out = model.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def full_forward_greedy(model: LoadedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy by definition, past EOS: the argmax of a plain full forward, token by token."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            tokens.append(int(model.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def assert_is_target_greedy(model: LoadedModel, prompt: list[int], tokens: list[int]) -> None:
    reference = hf_greedy(model, prompt, len(tokens))
    assert tokens[: len(reference)] == reference  # token for token, up to generate's EOS
    assert tokens == full_forward_greedy(model, prompt, len(tokens))


def speculate(
    drafter: Drafter,
    verifier: Verifier,
    session_id: str,
    prompt: list[int],
    block_lengths: Callable[[int], int],
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    new_tokens: int = NEW_TOKENS,
    reopen_at: int | None = None,
) -> list[int]:
    """Generate `new_tokens` tokens by draft-and-verify rounds; block length per round from
    `block_lengths` (0: target only). `reopen_at`: close and reopen both sessions once that
    many tokens exist (a session that leaves and rejoins mid-batch)."""
    verifier.open_session(session_id, prompt, sampling, seed)
    drafter.open_session(session_id, prompt, sampling, seed)
    tokens = list(prompt)
    appended: tuple[int, ...] = ()
    round_index = 0
    try:
        while len(tokens) - len(prompt) < new_tokens:
            if reopen_at is not None and len(tokens) - len(prompt) >= reopen_at:
                reopen_at = None
                for side in (drafter, verifier):
                    assert side.close_session(session_id)
                verifier.open_session(session_id, tokens, sampling, seed + 1)
                drafter.open_session(session_id, tokens, sampling, seed + 1)
                appended = ()
            k = block_lengths(round_index)
            round_index += 1
            if k == 0:
                block = DraftBlock(len(tokens), ())
            else:
                block = drafter.draft(session_id, len(tokens) - len(appended), appended, k)
            verdict = verifier.verify(
                session_id, DraftBlock(len(tokens), block.tokens, block.draft_probs)
            )
            tokens.extend(verdict.tokens)
            # The drafter learns the verdict with its next call: it rolls back its own rejected
            # drafts and appends what was committed since its base.
            appended = (*appended, *verdict.tokens) if k == 0 else verdict.tokens
    finally:
        drafter.close_session(session_id)
        verifier.close_session(session_id)
    return tokens[len(prompt) : len(prompt) + new_tokens]


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 250) for _ in range(rng.choice([1, 3, 9, 20, 45, 70]))]
        for _ in range(count)
    ]


def run_threads(jobs: list[Callable[[], list[int]]]) -> list[list[int]]:
    results: list[list[int] | BaseException | None] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as error:  # reported below, with its index
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            raise AssertionError(f"session {i} failed") from result
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("num_sessions", [1, 4, 16])
def test_batched_greedy_output_is_hf_generate_token_for_token(
    pair: tuple[Drafter, Verifier], reference_model: LoadedModel, num_sessions: int
) -> None:
    drafter, verifier = pair
    cases = prompts(num_sessions, seed=num_sessions)
    # Block lengths 0..8, varied per round and per session; some sessions leave and rejoin.
    jobs = [
        (
            lambda i=i, prompt=prompt: speculate(
                drafter,
                verifier,
                f"g{num_sessions}-{i}",
                prompt,
                lambda r, i=i: (i + 3 * r) % 9,
                reopen_at=10 if i % 5 == 2 else None,
            )
        )
        for i, prompt in enumerate(cases)
    ]
    batched = run_threads(jobs)
    for prompt, tokens in zip(cases, batched, strict=True):
        assert_is_target_greedy(reference_model, prompt, tokens)
    if num_sessions == 16:
        assert verifier.stats().engine.max_batch_sequences > 1  # type: ignore[union-attr]
        assert drafter.stats().engine.max_batch_sequences > 1  # type: ignore[union-attr]


def test_batched_output_equals_the_same_sessions_run_one_at_a_time(
    pair: tuple[Drafter, Verifier],
) -> None:
    drafter, verifier = pair
    cases = prompts(8, seed=99)
    alone = [
        speculate(drafter, verifier, f"alone-{i}", p, lambda r, i=i: (i + r) % 6)
        for i, p in enumerate(cases)
    ]
    batched = run_threads(
        [
            (lambda i=i, p=p: speculate(drafter, verifier, f"b-{i}", p, lambda r, i=i: (i + r) % 6))
            for i, p in enumerate(cases)
        ]
    )
    assert batched == alone


def test_a_seeded_request_samples_the_same_tokens_alone_and_batched(
    pair: tuple[Drafter, Verifier],
) -> None:
    drafter, verifier = pair
    prompt = prompts(1, seed=3)[0]

    def seeded(session_id: str) -> list[int]:
        return speculate(drafter, verifier, session_id, prompt, lambda r: 4, SAMPLED, seed=1234)

    alone = seeded("seeded-alone")
    others = [
        (
            lambda i=i: speculate(
                drafter,
                verifier,
                f"noise-{i}",
                prompts(1, seed=50 + i)[0],
                lambda r: 5,
                SAMPLED,
                seed=i,
            )
        )
        for i in range(6)
    ]
    batched = run_threads([lambda: seeded("seeded-batched"), *others])[0]
    assert batched == alone
    assert seeded("seeded-other-seed") != [] and alone != speculate(
        drafter, verifier, "seed-2", prompt, lambda r: 4, SAMPLED, seed=4321
    )


def test_kv_blocks_return_to_the_baseline_after_a_burst(pair: tuple[Drafter, Verifier]) -> None:
    drafter, verifier = pair
    before = [side.stats().engine.kv_blocks_used for side in pair]  # type: ignore[union-attr]
    run_threads(
        [
            (lambda i=i, p=p: speculate(drafter, verifier, f"burst-{i}", p, lambda r: 6))
            for i, p in enumerate(prompts(12, seed=11))
        ]
    )
    after = [side.stats().engine.kv_blocks_used for side in pair]  # type: ignore[union-attr]
    assert after == before == [0, 0]
    assert all(side.stats().num_sessions == 0 for side in pair)


def test_a_pool_too_small_preempts_an_idle_session_which_then_recomputes_exactly(
    reference_model: LoadedModel,
) -> None:
    # 8 blocks of 16 tokens. A new session must find room for its prompt plus a 33-token block.
    model = load(TINY_TARGET)
    bytes_per_block = 16 * _kv_bytes_per_token(model)
    config = VerifierConfig(
        kv_cache_bytes=8 * bytes_per_block, max_context_tokens=128, kv_overcommit=1.5
    )
    verifier = Verifier(model, config)
    try:
        assert verifier.stats().engine.kv_blocks_total == 8  # type: ignore[union-attr]
        a, b = (prompts(1, seed=s)[0][:1] * 40 for s in (5, 6))
        verifier.open_session("a", a, GREEDY, 0)  # 39 tokens cached: 3 blocks
        verifier.open_session("b", b, GREEDY, 0)  # 3 more; 2 free
        # Each plans 40 + 33 tokens, 5 blocks: a third would pass 1.5 x 8 planned blocks.
        with pytest.raises(ResourceExhaustedError, match="fully planned") as refused:
            verifier.open_session("c", a, GREEDY, 0)
        assert refused.value.retry_after_s is not None
        # a's 32-token block, all accepted, takes the last 2 blocks.
        block = full_forward_greedy(reference_model, a, 32)
        assert verifier.verify("a", DraftBlock(40, tuple(block))).num_accepted == 32
        # b cannot grow: it waits for the older a, then takes a's blocks once a idles.
        verdict = verifier.verify("b", DraftBlock(40, tuple([7] * 32)))
        expected_b = full_forward_greedy(reference_model, b, 1)
        assert list(verdict.tokens)[-1:] == expected_b[-1:] and verdict.num_accepted == 0
        engine = verifier.stats().engine
        assert engine is not None and engine.preemptions == 1 and engine.refusals == 1
        # a lost its KV but not its tokens: its next pass recomputes them and decodes exactly.
        verdict = verifier.verify("a", DraftBlock(73, ()))
        assert list(verdict.tokens) == full_forward_greedy(reference_model, a + block, 1)
        engine = verifier.stats().engine
        assert engine is not None and engine.recomputed_tokens >= 72
        for session_id in ("a", "b"):
            verifier.close_session(session_id)
        assert verifier.stats().engine.kv_blocks_used == 0  # type: ignore[union-attr]
    finally:
        verifier.close()


def _kv_bytes_per_token(model: LoadedModel) -> int:
    from cluster.runtime.kv_pool import kv_bytes_per_token

    return kv_bytes_per_token(model.model)


def test_a_closed_session_is_not_expected_back_by_either_engine(
    pair: tuple[Drafter, Verifier],
) -> None:
    # Read on the engine thread (a keyless call runs after the last task has fully finished).
    def expected(engine: Engine) -> bool:
        return engine.call(lambda: "closing" in engine._scheduler.finished_at)

    for side in pair:
        side.open_session("closing", prompts(1, seed=21)[0], GREEDY, 0)
        assert expected(side.engine)  # an ordinary call: its session may come back at once
        assert side.close_session("closing")
        assert not expected(side.engine)  # closed: no step waits for it


def test_a_request_with_less_time_left_than_the_queue_wait_is_refused_at_admission(
    pair: tuple[Drafter, Verifier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new session whose request has less time left than the engine's queue is expected to
    keep it waiting is refused with RESOURCE_EXHAUSTED and that wait as its retry hint; one
    with time enough, no deadline, or already running elsewhere (`resumed`) is admitted."""
    prompt = prompts(1, seed=31)[0]
    for side in pair:
        assert side.engine.expected_wait_s() == 0.0  # idle: nothing to wait behind
        monkeypatch.setattr(side.engine, "expected_wait_s", lambda: 5.0)
        refusals = side.stats().engine.refusals  # type: ignore[union-attr]
        with pytest.raises(ResourceExhaustedError, match="queue keeps a call waiting") as refused:
            side.open_session("late", prompt, GREEDY, 0, time_limit_s=1.0)
        assert refused.value.retry_after_s == 5.0
        assert side.stats().engine.refusals == refusals + 1  # type: ignore[union-attr]
        assert side.stats().num_sessions == 0
        side.open_session("in-time", prompt, GREEDY, 0, time_limit_s=10.0)
        side.open_session("no-deadline", prompt, GREEDY, 0)
        side.open_session("resumed", prompt, GREEDY, 0, time_limit_s=1.0, resumed=True)
        assert side.stats().num_sessions == 3
        for session_id in ("in-time", "no-deadline", "resumed"):
            side.close_session(session_id)
        monkeypatch.undo()
