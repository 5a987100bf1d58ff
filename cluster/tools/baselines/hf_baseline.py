"""Hugging Face target-only serving in this process: `tandem loadtest --hf-baseline`.

`TargetBaseline.run` keeps `concurrency` greedy streams busy on the target alone for
`duration_s`, as the load test's workers keep the service busy: the same prompts (token ids,
taken round-robin), the same `max_tokens`, a request starts only before the deadline and every
one counts whole. Two Hugging Face methods:

- `generate`: a padded batch `generate` (prompts left-padded, with an attention mask), in
  waves: a batch of `concurrency` requests runs to its end (its longest stream), then the next
  starts. Each step gives every unfinished stream one token, so a stream's inter-token latency
  is the step time; a stopping criterion (called once per step) stamps each step.
- `generate_batch`: transformers' continuous batching, through the manager `generate_batch`
  wraps: `concurrency` requests in flight, the next submitted as one finishes. Its paged cache
  is sized to that load (`_batching_config`), not to free memory (its default: 60% of RAM on
  CPU, slow to allocate and to read), and shares no prefix blocks: each request pays its own
  prefill, as on the service.

Both decode greedily with a plain config (no repetition penalty or other processors a model's
`generation_config` may carry) and stop at the model's end-of-sequence ids, keeping the one
that ends a stream, as the service does. `choose_method` probes both briefly at one level and
keeps the faster. The threads of a continuous batching run are stopped however the run ends
(an error, Ctrl-C, or SIGTERM once the caller made it raise: `cluster.tools.cleanup`), and
`close` frees the model. torch's intra-op threads are set to `threads` while a run lasts.
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.tools.bench.loadtest import percentile

METHODS = ("generate", "generate_batch")
PAGE_TOKENS = 32
"""Tokens per page of the continuous batching cache: small, so the cache (which every step's
attention reads on CPU) holds little more than the streams in flight."""
RESULT_POLL_S = 0.5
STOP_TIMEOUT_S = 30.0
MAX_REQUESTS = 1_000_000
"""A hard bound on one run's requests, whatever the duration."""


@dataclass
class LevelRun:
    """What one run measured; `summary` is its JSON."""

    method: str
    concurrency: int
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)
    """Tokens of each completed request."""
    first_token_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    outputs: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    """The first output of each distinct prompt (a baseline must be the target's output)."""

    def add(self, prompt: tuple[int, ...], tokens: Sequence[int], stamps: Sequence[float],
            started: float) -> None:  # fmt: skip
        """One completed request: its tokens, each token's time, and its start time."""
        self.lengths.append(len(tokens))
        self.outputs.setdefault(prompt, tuple(tokens))
        if stamps:
            self.first_token_s.append(stamps[0] - started)
            self.inter_token_s.extend(b - a for a, b in itertools.pairwise(stamps))

    def summary(self) -> dict[str, Any]:
        tokens = sum(self.lengths)
        return {
            "method": self.method,
            "concurrency": self.concurrency,
            "seconds": self.seconds,
            "requests": len(self.lengths),
            "tokens": tokens,
            "tokens_per_s": tokens / self.seconds if self.seconds > 0 else 0.0,
            "ttft_ms": _millis(self.first_token_s),
            "itl_ms": _millis(self.inter_token_s),
        }


def _millis(values: Sequence[float]) -> dict[str, float | None]:
    return {
        name: None if (v := percentile(values, q)) is None else 1000 * v
        for name, q in (("p50", 0.5), ("p99", 0.99))
    }


class _StepStamps(StoppingCriteria):
    """Stamps each decoding step (`generate` calls it once per new token of the batch)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TargetBaseline:
    """The target model, loaded once, and the runs made with it."""

    def __init__(self, loaded: LoadedModel, threads: int) -> None:
        if threads < 1:
            raise InvalidArgumentError(f"the baseline needs >= 1 thread, got {threads}")
        self._loaded: LoadedModel | None = loaded
        self.threads = threads
        self.eos_ids = tuple(sorted(loaded.eos_token_ids))
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else self.eos_ids[0]

    @classmethod
    def load(cls, spec: ModelSpec, threads: int) -> TargetBaseline:
        return cls(load_model(spec), threads)

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise RuntimeError("the baseline's model was freed")
        return self._loaded

    def encode(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Prompt ids as the service makes them (`add_special_tokens=False`)."""
        tokenizer = self.loaded.tokenizer
        return [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in texts]

    def close(self) -> None:
        """Free the model (its memory returns once nothing else holds it)."""
        self._loaded = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> TargetBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, max_tokens: int) -> GenerationConfig:
        # Every field set, so that none is filled in from the model's own generation config.
        return GenerationConfig(
            do_sample=False, max_new_tokens=max_tokens, eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id, repetition_penalty=1.0, num_beams=1,
        )  # fmt: skip

    def _trim(self, tokens: Sequence[int]) -> list[int]:
        """The tokens up to and including the first end-of-sequence id."""
        eos = set(self.eos_ids)
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        return list(tokens[:end])

    def run(
        self,
        method: str,
        prompts: Sequence[tuple[int, ...]],
        concurrency: int,
        duration_s: float,
        max_tokens: int,
    ) -> LevelRun:
        """Keep `concurrency` streams of `prompts` busy for `duration_s` with `method`."""
        if method not in METHODS:
            raise InvalidArgumentError(f"method must be one of {', '.join(METHODS)}, got {method}")
        if not prompts or concurrency < 1 or max_tokens < 1:
            raise InvalidArgumentError("a baseline run needs prompts, concurrency and max_tokens")
        runner = self._run_padded if method == "generate" else self._run_continuous
        log = LevelRun(method, concurrency)
        with _threads(self.threads), torch.inference_mode():
            self._warm_up(prompts[0])
            runner(log, prompts, concurrency, duration_s, max_tokens)
        return log

    def _warm_up(self, prompt: tuple[int, ...]) -> None:
        """One short generation: the first call of a process pays one-off costs."""
        model: Any = self.loaded.model  # transformers' `generate` is opaque to type checkers
        ids = torch.tensor([prompt], device=self.loaded.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(2))

    def _run_padded(self, log: LevelRun, prompts: Sequence[tuple[int, ...]], concurrency: int,
                    duration_s: float, max_tokens: int) -> None:  # fmt: skip
        started = time.perf_counter()
        deadline, next_index = started + duration_s, 0
        # The first wave starts whatever the duration, as the first requests of every stream.
        while next_index == 0 or (time.perf_counter() < deadline and next_index < MAX_REQUESTS):
            batch = [prompts[(next_index + i) % len(prompts)] for i in range(concurrency)]
            next_index += concurrency
            self._padded_wave(log, batch, max_tokens)
        log.seconds = time.perf_counter() - started

    def _padded_wave(self, log: LevelRun, batch: list[tuple[int, ...]], max_tokens: int) -> None:
        width = max(len(ids) for ids in batch)
        device = self.loaded.device
        ids = torch.tensor(
            [[self.pad_id] * (width - len(p)) + list(p) for p in batch], device=device
        )
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        steps = _StepStamps()
        started = time.perf_counter()
        model: Any = self.loaded.model
        out = model.generate(
            ids, attention_mask=mask, generation_config=self._config(max_tokens),
            stopping_criteria=StoppingCriteriaList([steps]),
        )  # fmt: skip
        for prompt, row in zip(batch, out[:, width:].tolist(), strict=True):
            tokens = self._trim(row)
            log.add(prompt, tokens, steps.stamps[: len(tokens)], started)

    def _run_continuous(self, log: LevelRun, prompts: Sequence[tuple[int, ...]], concurrency: int,
                        duration_s: float, max_tokens: int) -> None:  # fmt: skip
        """Timed from the first submission to the last completion: the manager's start (its
        cache) and its stop are not part of serving."""
        model: Any = self.loaded.model
        manager = model.init_continuous_batching(
            generation_config=self._config(max_tokens),
            continuous_batching_config=_batching_config(
                concurrency, max(len(p) for p in prompts), max_tokens
            ),
        )
        in_flight: dict[str, tuple[tuple[int, ...], float]] = {}
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            prompt = prompts[submitted % len(prompts)]
            submitted += 1
            request_id = manager.add_request(list(prompt), max_new_tokens=max_tokens,
                                             record_timestamps=True)  # fmt: skip
            if request_id is None:
                raise RuntimeError("continuous batching refused a request")
            in_flight[request_id] = (prompt, time.perf_counter())

        manager.start()
        finished = False
        try:
            started = time.perf_counter()
            deadline = started + duration_s
            for _ in range(concurrency):
                submit()
            while in_flight:
                result = manager.get_result(timeout=RESULT_POLL_S)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if not result.is_finished() or result.request_id not in in_flight:
                    continue
                if result.error is not None:
                    raise RuntimeError(f"continuous batching failed a request: {result.error}")
                prompt, submitted_at = in_flight.pop(result.request_id)
                tokens = self._trim(result.generated_tokens)
                log.add(prompt, tokens, (result.timestamps or [])[: len(tokens)], submitted_at)
                if time.perf_counter() < deadline and submitted < MAX_REQUESTS:
                    submit()
            log.seconds = time.perf_counter() - started
            finished = True
        finally:
            # Interrupted, fail what is left at once instead of finishing it.
            manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=not finished)
            manager.destroy()


def _batching_config(
    concurrency: int, longest_prompt: int, max_tokens: int
) -> ContinuousBatchingConfig:
    """A cache for `concurrency` requests of up to `longest_prompt + max_tokens` tokens, one
    spare page each; a step may hold one whole prompt beside a token for every stream."""
    pages = math.ceil((longest_prompt + max_tokens) / PAGE_TOKENS) + 1
    return ContinuousBatchingConfig(
        page_size=PAGE_TOKENS,
        num_blocks=concurrency * pages,
        max_batch_tokens=longest_prompt + concurrency,
        max_requests_per_batch=concurrency,
        allow_block_sharing=False,
        safety_margin=0.0,  # sized for exactly the streams in flight: admit them all
    )


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def choose_method(
    baseline: TargetBaseline,
    prompts: Sequence[tuple[int, ...]],
    concurrency: int,
    probe_s: float,
    max_tokens: int,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Probe both methods for `probe_s` at `concurrency`; the faster one, why, and the probes."""
    probes: dict[str, float] = {}
    for method in METHODS:
        progress(f"probing hf {method} at concurrency {concurrency} for {probe_s:.0f} s")
        probes[method] = baseline.run(method, prompts, concurrency, probe_s, max_tokens).summary()[
            "tokens_per_s"
        ]
    best = max(METHODS, key=lambda m: probes[m])
    other = next(m for m in METHODS if m != best)
    why = (
        f"faster in a {probe_s:g} s probe at concurrency {concurrency}: "
        f"{probes[best]:.2f} tokens/s against {probes[other]:.2f} for {other}"
    )
    return {"method": best, "why": why, "probe_tokens_per_s": probes}
