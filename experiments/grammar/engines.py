"""The grammar engines the grammar bench (`experiments.grammar.bench`) measures, each behind one
small interface.

A `GrammarEngine` builds its view of a tokenizer and compiles a `Workload` into a `Matcher`; a
`Matcher` writes full-vocabulary masks, consumes tokens, rolls back and resets, and fills the
masks of a k + 1 block by the plain loop or, where the engine has one, by its own
speculative-decoding call. The adapters: llguidance, xgrammar and outlines-core.

Only llguidance is a Tandem dependency: each engine's package is imported inside its adapter,
so only in the child process that measures it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from experiments.grammar.workloads import JSON_SCHEMA, LARK, REGEX, Workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENGINES = ("llguidance", "xgrammar", "outlines-core")

Words = NDArray[np.int32]
"""A mask: `[(vocab + 31) // 32]` words, token t allowed when bit t % 32 of word t // 32 is set;
blocks of them are `[k + 1, words]`."""


class Matcher(ABC):
    """One engine's matcher for one constraint, standing after the tokens it consumed."""

    has_native_block = False

    @abstractmethod
    def fill(self, out: Words) -> None:
        """The mask of the next token, written over `out` `[words]`."""

    @abstractmethod
    def consume(self, token: int) -> bool:
        """Advance by `token`; False if the constraint forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...

    def fill_block(self, drafts: Sequence[int], out: Words) -> None:
        """The masks at the `len(drafts) + 1` positions of a block into `out` `[k + 1, words]`,
        by the plain loop; the matcher ends where it began."""
        taken = 0
        for i in range(len(drafts) + 1):
            self.fill(out[i])
            if i == len(drafts) or not self.consume(drafts[i]):
                break
            taken += 1
        self.rollback(taken)

    def fill_block_native(self, drafts: Sequence[int], out: Words) -> None:
        """As `fill_block`, by the engine's own call (where `has_native_block`)."""
        raise NotImplementedError


class GrammarEngine(ABC):
    """A grammar engine: its tokenizer view, and a compiler of workloads into matchers."""

    name: str
    module: str
    kinds: tuple[str, ...] = (JSON_SCHEMA, REGEX, LARK)
    rollback_api: str
    block_api: str

    @abstractmethod
    def load(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
        """Build the engine's view of `tokenizer` over `vocab_size` ids."""

    @abstractmethod
    def compile(self, workload: Workload) -> Matcher:
        """A matcher ready for its first mask; raises on a constraint it cannot take."""


class _LlguidanceMatcher(Matcher):
    has_native_block = True

    def __init__(self, matcher: Any, executor: Any) -> None:
        self._matcher = matcher
        self._executor = executor

    def fill(self, out: Words) -> None:
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, token: int) -> bool:
        return bool(self._matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance rollback failed: {self._matcher.get_error()}")

    def reset(self) -> None:
        self._matcher.reset()

    def fill_block_native(self, drafts: Sequence[int], out: Words) -> None:
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [(self._matcher, 0, list(drafts))], out.ctypes.data, out.shape[1] * 4, out.shape[0]
        )


class Llguidance(GrammarEngine):
    name = "llguidance"
    module = "llguidance"
    rollback_api = "LLMatcher.rollback(n)"
    block_api = "LLExecutor.unsafe_compute_mask_ptr_with_draft_token"

    def load(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, workload: Workload) -> Matcher:
        from llguidance import LLMatcher

        if workload.kind == JSON_SCHEMA:
            # Compact JSON, as Tandem generates it (cluster.runtime.constraint).
            grammar = LLMatcher.grammar_from_json_schema(
                workload.source, defaults={"whitespace_flexible": False}
            )
        elif workload.kind == REGEX:
            grammar = LLMatcher.grammar_from_regex(workload.source)
        else:
            grammar = LLMatcher.grammar_from_lark(workload.source)
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return _LlguidanceMatcher(matcher, self._executor)


class _XgrammarMatcher(Matcher):
    has_native_block = True

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, out: Words) -> None:
        self._matcher.fill_next_token_bitmask(out)

    def consume(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()

    def fill_block_native(self, drafts: Sequence[int], out: Words) -> None:
        import torch

        # A chain: node i's child is node i + 1. Node 0 is where the matcher stands; its token
        # is the last one consumed and is not read.
        num_nodes = len(drafts) + 1
        next_token = torch.arange(1, num_nodes + 1, dtype=torch.int64)
        next_token[-1] = -1
        next_sibling = torch.full((num_nodes,), -1, dtype=torch.int64)
        tokens = torch.tensor([0, *drafts], dtype=torch.int64)
        self._matcher.traverse_draft_tree(next_token, next_sibling, tokens, torch.from_numpy(out))


class Xgrammar(GrammarEngine):
    name = "xgrammar"
    module = "xgrammar"
    rollback_api = "GrammarMatcher.rollback(n)"
    block_api = "GrammarMatcher.traverse_draft_tree (a chain is a one-branch tree)"

    def load(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
        import xgrammar  # type: ignore[import-not-found, unused-ignore]

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # No cache: each compile is timed from scratch, as a new schema would be.
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, workload: Workload) -> Matcher:
        import xgrammar  # type: ignore[import-not-found, unused-ignore]

        if workload.kind == JSON_SCHEMA:
            compiled = self._compiler.compile_json_schema(
                workload.source, any_whitespace=False, separators=(",", ":")
            )
        elif workload.kind == REGEX:
            compiled = self._compiler.compile_regex(workload.source)
        else:
            compiled = self._compiler.compile_lark(workload.source)
        return _XgrammarMatcher(xgrammar.GrammarMatcher(compiled))


class _OutlinesCoreMatcher(Matcher):
    def __init__(self, guide: Any) -> None:
        self._guide = guide

    def fill(self, out: Words) -> None:
        self._guide.write_mask_into(out.ctypes.data, out.size, 4)

    def consume(self, token: int) -> bool:
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        self._guide.rollback_state(num_tokens)

    def reset(self) -> None:
        self._guide.reset()


class OutlinesCore(GrammarEngine):
    name = "outlines-core"
    module = "outlines_core"
    kinds = (JSON_SCHEMA, REGEX)
    rollback_api = "Guide.rollback_state(n) (Guide(index, max_rollback=32))"
    block_api = "none: the plain loop (advance, write_mask_into, rollback_state)"

    def load(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
        import outlines_core  # type: ignore[import-not-found, unused-ignore]

        # Vocabulary.from_pretrained downloads from the Hugging Face hub; the vocabulary is
        # built from the local tokenizer instead (byte-level BPE: each character is one byte).
        byte_of = {char: byte for byte, char in _byte_level_alphabet().items()}
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id in special or token_id >= vocab_size:
                continue
            # An added token outside the alphabet stands for its own text.
            data = bytes(byte_of[c] for c in text) if set(text) <= byte_of.keys() else text.encode()
            tokens.setdefault(data, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, workload: Workload) -> Matcher:
        import outlines_core  # type: ignore[import-not-found, unused-ignore]

        regex = workload.source
        if workload.kind == JSON_SCHEMA:
            regex = outlines_core.json_schema.build_regex_from_schema(
                workload.source, whitespace_pattern=""
            )
        index = outlines_core.Index(regex, self._vocabulary)
        return _OutlinesCoreMatcher(outlines_core.Guide(index, max_rollback=32))


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    alphabet = {b: chr(b) for b in printable}
    for shift, b in enumerate(b for b in range(256) if b not in alphabet):
        alphabet[b] = chr(256 + shift)
    return alphabet


def engine(name: str) -> GrammarEngine:
    engines: dict[str, type[GrammarEngine]] = {
        "llguidance": Llguidance,
        "xgrammar": Xgrammar,
        "outlines-core": OutlinesCore,
    }
    return engines[name]()
