"""Constrained generation: which tokens a request's grammar allows at each position.

A request may constrain its output to a JSON schema, any JSON object, a regular expression or a
Lark grammar (`Grammar`), and may forbid its end tokens until `min_tokens` exist. The
constrained target distribution at a position is the target's p masked to the allowed tokens and
renormalised; the sampling settings (temperature, top-k, top-p) then apply to that, in that
order (`mask_logits` sets the forbidden logits to -inf before `logits_to_probs`). Drafter and
verifier each keep a `TokenMatcher` per session, over their own tokenizer: the drafter masks its
q at each drafted position, the verifier masks p at each of a block's k + 1 positions by
advancing its matcher along the drafted tokens (`TokenMatcher.block_masks`), so a drafted
token the grammar forbids has p = 0 and is rejected by every acceptance rule. The grammar engine
is llguidance (docs/grammar-engines.md): its masks are computed in Rust with the GIL released,
so the masks of a block are computed on a worker thread while the forward pass runs.

A matcher follows the session's generated tokens: `sync` rolls it back to where they agree and
advances it along the rest, so a rejected draft, a pipelined block or a failover (a session
opened over tokens already generated) all come down to one call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer
from transformers import PreTrainedTokenizerBase

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.grammar import (  # noqa: F401  (re-exported: the constraint's vocabulary)
    GRAMMAR_KINDS,
    JSON_OBJECT,
    JSON_SCHEMA,
    LARK,
    REGEX,
    Grammar,
)
from cluster.runtime.kv_cache import common_prefix_length

logger = logging.getLogger(__name__)

MASK_THREADS = 4
"""Workers computing masks beside the forward passes (llguidance releases the GIL)."""


@dataclass(frozen=True)
class Constraint:
    """A session's constraint: its grammar (None: any text), and its end tokens forbidden
    until `min_tokens` tokens are generated. `prompt_length`: where the generated tokens
    start in the session's token sequence."""

    grammar: Grammar | None = None
    min_tokens: int = 0
    end_token_ids: frozenset[int] = field(default_factory=frozenset)
    prompt_length: int = 0

    def __post_init__(self) -> None:
        if self.min_tokens < 0 or self.prompt_length < 0:
            raise InvalidArgumentError(
                f"min_tokens and prompt_length must be >= 0, got {self.min_tokens}, "
                f"{self.prompt_length}"
            )

    @property
    def active(self) -> bool:
        """Whether it masks anything at all."""
        return self.grammar is not None or (self.min_tokens > 0 and bool(self.end_token_ids))


@dataclass
class MaskTimes:
    """What masks cost in this process, for benchmarks: rows (positions) masked, seconds spent
    computing them on the worker threads, and seconds a forward pass's caller then still
    waited for them (the part not hidden behind the forward pass)."""

    rows: int = 0
    compute_s: float = 0.0
    waited_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, rows: int = 0, compute_s: float = 0.0, waited_s: float = 0.0) -> None:
        with self._lock:
            self.rows += rows
            self.compute_s += compute_s
            self.waited_s += waited_s

    def snapshot(self) -> tuple[int, float, float]:
        with self._lock:
            return self.rows, self.compute_s, self.waited_s


MASK_TIMES = MaskTimes()


def wait_for(masks: Future[torch.Tensor] | None) -> torch.Tensor | None:
    """The masks once computed (None for None), the wait counted in `MASK_TIMES`."""
    if masks is None:
        return None
    start = time.perf_counter()
    try:
        return masks.result()
    finally:
        MASK_TIMES.add(waited_s=time.perf_counter() - start)


class GrammarTokenizers:
    """llguidance's view of each tokenizer, built once per (tokenizer, vocabulary width): a
    build reads the whole vocabulary (about a second for 152k ids)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[tuple[int, int], LLTokenizer] = {}
        self._keep: list[PreTrainedTokenizerBase] = []  # ids stay valid while cached

    def built(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> bool:
        """Whether the view of `tokenizer` at `vocab_size` ids is built already."""
        with self._lock:
            return (id(tokenizer), vocab_size) in self._built

    def get(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int]
    ) -> LLTokenizer:
        """Raises InvalidArgumentError for a tokenizer llguidance cannot read (a slow one)."""
        key = (id(tokenizer), vocab_size)
        with self._lock:
            built = self._built.get(key)
            if built is None:
                try:
                    built = llguidance.hf.from_tokenizer(
                        tokenizer,  # type: ignore[arg-type]
                        n_vocab=vocab_size,
                        eos_token=sorted(eos_ids),
                    )
                except (ValueError, TypeError, RuntimeError) as error:
                    raise InvalidArgumentError(
                        f"this model's tokenizer cannot be constrained: {error}"
                    ) from None
                self._built[key] = built
                self._keep.append(tokenizer)
            return built


GRAMMAR_TOKENIZERS = GrammarTokenizers()
"""The process's cache (a replica, a router)."""


def grammar_tokenizer_of(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int]
) -> Callable[[], LLTokenizer]:
    """llguidance's view of `tokenizer` over its own vocabulary, built on the first call (a
    router's, to check grammars and cut prompt lookup's drafts)."""
    ends = sorted(eos_ids)
    return lambda: GRAMMAR_TOKENIZERS.get(tokenizer, len(tokenizer), ends)


def warm_up(view: Callable[[], LLTokenizer]) -> threading.Thread:
    """Build a tokenizer's view (`view`: `grammar_tokenizer_of`'s, or a replica's) on a
    background thread now, as a server starts, so that its first constrained request does not
    wait 1-3 s for the build; one that arrives during it waits for this build rather than
    starting another (`GrammarTokenizers.get` holds its lock). A tokenizer llguidance cannot
    read is only logged here: the constrained requests that need it are refused as before."""

    def build() -> None:
        try:
            view()
        except InvalidArgumentError as error:
            logger.info("constrained requests will be refused: %s", error)

    thread = threading.Thread(target=build, name="grammar-tokenizer", daemon=True)
    thread.start()
    return thread


def tokenizer_size(tokenizer: LLTokenizer | None) -> int:
    """The vocabulary a matcher over `tokenizer` masks (a grammar-free matcher: any width)."""
    return tokenizer.vocab_size if tokenizer is not None else 2**31 - 1


def check_grammar(grammar: Grammar, tokenizer: LLTokenizer) -> None:
    """InvalidArgumentError naming `grammar.<kind>` unless `grammar` compiles for `tokenizer`:
    a schema with an unsupported keyword, a regex or grammar that does not parse."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar.compiled(), tokenizer)
    if failed:
        raise InvalidArgumentError(f"grammar.{grammar.kind} does not compile: {messages[0]}")


class TokenMatcher:
    """Where one session stands in its constraint, over one model's vocabulary."""

    def __init__(self, constraint: Constraint, tokenizer: LLTokenizer | None, vocab_size: int):
        """`tokenizer`: llguidance's view of the session's tokenizer (needed with a grammar)."""
        self.constraint = constraint
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._matcher: LLMatcher | None = None
        if constraint.grammar is not None:
            if tokenizer is None:
                raise InvalidArgumentError("a grammar needs the model's tokenizer")
            self._matcher = LLMatcher(tokenizer, constraint.grammar.compiled(), log_level=0)
            if self._matcher.is_error():
                raise InvalidArgumentError(
                    f"grammar.{constraint.grammar.kind} does not compile: "
                    f"{self._matcher.get_error()}"
                )
        ends = sorted(t for t in constraint.end_token_ids if 0 <= t < vocab_size)
        self._ends = np.array(ends, dtype=np.int64)
        self._ends_set = frozenset(ends)
        self.consumed: list[int] = []
        """The generated tokens the matcher stands after."""
        self._fed = 0
        """How many of `consumed` llguidance took: those before its grammar was complete."""

    @property
    def complete(self) -> bool:
        """Whether the grammar is done: only an end token may follow."""
        return self._matcher is not None and self._matcher.is_stopped()

    def sync(self, generated: Sequence[int]) -> None:
        """Stand after exactly `generated`: roll back to where it agrees with what was
        consumed, then consume the rest. InvalidArgumentError if the grammar forbids one of
        them (the matcher then stands after the allowed prefix)."""
        common = common_prefix_length(generated, self.consumed)
        self.rollback(len(self.consumed) - common)
        self.consume(generated[common:])

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance along `tokens`; InvalidArgumentError at the first one the constraint
        forbids (the matcher then stands after the ones before it)."""
        for token in tokens:
            token = int(token)
            if not self._may_follow(token):
                raise InvalidArgumentError(
                    f"token {token} after {len(self.consumed)} generated tokens breaks the "
                    "request's constraint"
                )
            self.consumed.append(token)

    def _may_follow(self, token: int) -> bool:
        """Whether `token` is allowed where the matcher stands; if so, take it."""
        if not 0 <= token < self.vocab_size:
            return False
        matcher = self._matcher
        stopped = matcher is not None and matcher.is_stopped()
        early_end = len(self.consumed) < self.constraint.min_tokens and token in self._ends_set
        # Rare cases the mask decides: an end token before min_tokens; a complete grammar,
        # where llguidance takes only its end tokens and keeps no record of them.
        if early_end and matcher is None:
            return False
        if (stopped or early_end) and not self._mask_here(len(self.consumed))[token]:
            return False
        if matcher is None or stopped:
            return True
        if matcher.try_consume_tokens([token]) != 1:
            return False
        self._fed += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed tokens."""
        if num_tokens <= 0:
            return
        kept = len(self.consumed) - num_tokens
        if self._matcher is not None and self._fed > kept:
            if not self._matcher.rollback(self._fed - kept):
                raise InvalidArgumentError(f"the grammar could not roll back {num_tokens} tokens")
            self._fed = kept
        del self.consumed[kept:]

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from where the matcher stands, the constraint allows in a row
        (prompt lookup's drafts are cut there). The matcher ends where it began."""
        count = 0
        try:
            for token in tokens:
                if not self._may_follow(int(token)):
                    break
                self.consumed.append(int(token))
                count += 1
        finally:
            self.rollback(count)
        return count

    def block_masks(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The allowed tokens at each of the `len(drafts) + 1` positions of a block, as bool
        rows `[k + 1, vocab]`, found by advancing along the drafts; and how many drafts the
        constraint allows in a row. Rows after the first forbidden draft repeat its row (those
        positions are never reached: that draft is rejected). The matcher ends where it began."""
        start = time.perf_counter()
        rows = np.zeros((len(drafts) + 1, self.vocab_size), dtype=np.bool_)
        allowed = 0
        taken = 0
        try:
            for i in range(len(drafts) + 1):
                rows[i] = self._mask_here(len(self.consumed) + i)
                if i == len(drafts):
                    break
                token = int(drafts[i])
                if not (0 <= token < self.vocab_size and rows[i, token]):
                    rows[i + 1 :] = rows[i]
                    break
                allowed += 1
                if self._matcher is not None and not self._matcher.is_stopped():
                    if self._matcher.try_consume_tokens([token]) != 1:  # the mask allowed it
                        raise InvalidArgumentError(f"the grammar refused token {token}")
                    taken += 1
        finally:
            if taken and self._matcher is not None and not self._matcher.rollback(taken):
                raise InvalidArgumentError(f"the grammar could not roll back {taken} tokens")
            MASK_TIMES.add(rows=min(allowed + 1, len(rows)), compute_s=time.perf_counter() - start)
        return torch.from_numpy(rows), allowed

    def _mask_here(self, generated: int) -> np.ndarray:  # -> bool [vocab]
        """The allowed tokens after `generated` tokens, where the matcher stands now."""
        if self._matcher is None:
            row = np.ones(self.vocab_size, dtype=np.bool_)
        else:
            words = np.zeros(self._words, dtype=np.int32)
            self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")
            row = bits[: self.vocab_size].astype(np.bool_)
        if generated < self.constraint.min_tokens and len(self._ends):
            kept = row.copy()
            kept[self._ends] = False
            if kept.any():  # a grammar that can only end now wins over min_tokens
                row = kept
        return row


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` `[n, vocab]` with every token `allowed` (bool `[n, vocab]`) forbids
    set to -inf (the forward pass's logits are inference tensors: not changed in place)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


_POOL = ThreadPoolExecutor(max_workers=MASK_THREADS, thread_name_prefix="tandem-masks")


def masks_ahead(matcher: TokenMatcher, drafts: Sequence[int]) -> Future[torch.Tensor]:
    """The rows of `matcher.block_masks(drafts)`, computed on a worker thread: started before
    a forward pass, ready after it. The caller leaves the matcher alone until it is done."""
    return _POOL.submit(lambda: matcher.block_masks(tuple(drafts))[0])
