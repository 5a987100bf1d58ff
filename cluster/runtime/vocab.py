"""A trimmed draft vocabulary (FR-Spec): the draft scores only the most frequent token ids.

A draft model's output head is one of its largest reads per token: Qwen2.5's 0.5B model spends
136M of its 494M weights on the 151,936-row head. Scoring only the N most frequent ids reads
N rows instead. The lossless rule makes this safe: the draft's q is exactly the softmax over the
kept ids and zero elsewhere, the token it proposes is drawn from that q, and the verifier accepts
against that same q, so a token outside the subset still comes from the target (as a residual
draw or a bonus token), and the output distribution is the target's.

How often each id occurs is counted once over a corpus that ships with Python itself, so every
machine can build it without a network:

- code: the standard library's own sources (`*.py` under the stdlib folder, tests and IDLE left
  out), ~11 MB on CPython 3.11;
- English prose: the text of the Python reference documentation bundled as `pydoc_data.topics`
  (~0.5 MB).

The table (a count per id, plus the corpus's size and source) is stored as JSON beside the model
it belongs to: in a model folder (a fetched pack's draft folders get theirs when fetched), else
under the model cache, named by the tokenizer's digest. Building it tokenizes the corpus once
(seconds with a fast tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

CORPUS_VERSION = 1
"""Bumped whenever the corpus changes, so that stored tables are rebuilt."""
TABLE_FILE = "token_frequencies.json"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
BATCH_FILES = 64


@dataclass(frozen=True)
class FrequencyTable:
    """How often each token id occurs in the corpus, and what the corpus was."""

    counts: tuple[int, ...]
    """Occurrences per id, `len` = the logits' width."""
    source: str
    corpus_bytes: int
    corpus_tokens: int
    version: int = CORPUS_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "source": self.source,
                "corpus_bytes": self.corpus_bytes,
                "corpus_tokens": self.corpus_tokens,
                "counts": list(self.counts),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> FrequencyTable:
        data: dict[str, Any] = json.loads(text)
        return cls(
            counts=tuple(int(c) for c in data["counts"]),
            source=str(data["source"]),
            corpus_bytes=int(data["corpus_bytes"]),
            corpus_tokens=int(data["corpus_tokens"]),
            version=int(data["version"]),
        )


def stdlib_sources() -> list[Path]:
    """The standard library's `.py` files, in a stable order (tests and IDLE left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    )


def corpus_texts(limit_bytes: int | None = None) -> Iterator[str]:
    """The corpus's documents: the reference documentation's prose first, then the stdlib's
    sources, stopping once `limit_bytes` (UTF-8) have been given (None: all of it)."""
    import pydoc_data.topics

    given = 0

    def documents() -> Iterator[str]:
        yield from pydoc_data.topics.topics.values()
        for path in stdlib_sources():
            yield path.read_text(encoding="utf-8", errors="replace")

    for text in documents():
        if limit_bytes is not None and given >= limit_bytes:
            return
        given += len(text.encode("utf-8"))
        yield text


def count_tokens(tokenizer: Any, texts: Iterable[str], width: int) -> tuple[list[int], int, int]:
    """Occurrences of each id below `width` over `texts` (tokenized in batches, no special
    tokens); returns (counts, corpus bytes, corpus tokens)."""
    counts = torch.zeros(width, dtype=torch.int64)
    n_bytes = n_tokens = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_tokens
        if not batch:
            return
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            row = torch.tensor(ids, dtype=torch.int64)
            row = row[row < width]
            counts.add_(torch.bincount(row, minlength=width))
            n_tokens += len(ids)
        batch.clear()

    for text in texts:
        n_bytes += len(text.encode("utf-8"))
        batch.append(text)
        if len(batch) >= BATCH_FILES:
            flush()
    flush()
    return counts.tolist(), n_bytes, n_tokens


def build_table(tokenizer: Any, width: int, limit_bytes: int | None = None) -> FrequencyTable:
    """Count the corpus (`corpus_texts`) with `tokenizer`."""
    counts, n_bytes, n_tokens = count_tokens(tokenizer, corpus_texts(limit_bytes), width)
    return FrequencyTable(
        counts=tuple(counts),
        source="pydoc_data.topics + the Python standard library's sources (tests, IDLE excluded)",
        corpus_bytes=n_bytes,
        corpus_tokens=n_tokens,
    )


def tokenizer_digest(tokenizer: Any) -> str:
    """A short digest of the tokenizer's vocabulary: tables are per tokenizer."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def table_path(source: str, tokenizer: Any) -> Path:
    """Where the table for a model from `source` is stored: in its folder, else in the model
    cache under the tokenizer's digest."""
    folder = Path(source).expanduser()
    if folder.is_dir() and os.access(folder, os.W_OK):
        return folder / TABLE_FILE
    from cluster.runtime.pack_catalog import cache_root

    return cache_root() / "token-frequencies" / f"{tokenizer_digest(tokenizer)}.json"


def load_or_build(path: Path, tokenizer: Any, width: int) -> FrequencyTable:
    """The table stored at `path` when it is current and as wide as the logits, else a new
    one, stored there (written whole or not at all)."""
    if path.exists():
        try:
            table = FrequencyTable.from_json(path.read_text())
        except (ValueError, KeyError, TypeError):
            table = None  # unreadable: built again below
        if table is not None and table.version == CORPUS_VERSION and len(table.counts) == width:
            return table
    table = build_table(tokenizer, width)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(table.to_json())
    partial.replace(path)
    return table


def kept_token_ids(counts: Iterable[int], size: int, always: Iterable[int] = ()) -> Tensor:
    """The `size` most frequent ids (ties broken by the lower id), plus `always` (end of
    sequence ids, so that a draft can end a generation), sorted."""
    counts_t = torch.tensor(list(counts), dtype=torch.int64)
    width = counts_t.numel()
    if size < 1:
        raise ValueError(f"a trimmed vocabulary needs at least one id, got {size}")
    # Stable sort on descending counts keeps the lower id first among equals.
    order = torch.sort(-counts_t, stable=True).indices
    kept = set(order[: min(size, width)].tolist())
    kept.update(i for i in always if 0 <= i < width)
    return torch.tensor(sorted(kept), dtype=torch.int64)


class TrimmedHead(nn.Module):
    """An output head that scores only `kept` ids; the logits keep their full width, with
    -inf at every other id, so softmax, argmax and top-k/top-p see a q that is exactly zero
    outside the subset."""

    def __init__(self, head: nn.Linear, kept: Tensor) -> None:
        super().__init__()
        weight = head.weight.detach()
        self.proj = nn.Linear(
            head.in_features, len(kept), bias=head.bias is not None,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            self.proj.weight.copy_(weight[kept.to(weight.device)])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias.detach()[kept.to(weight.device)])
        self.kept: Tensor
        self.register_buffer("kept", kept.to(weight.device))
        self.in_features, self.out_features = head.in_features, head.out_features

    def forward(self, x: Tensor) -> Tensor:
        scores = self.proj(x)
        out = scores.new_full((*scores.shape[:-1], self.out_features), float("-inf"))
        out[..., self.kept] = scores
        return out


def trim_output_head(model: nn.Module, kept: Tensor) -> None:
    """Replace `model`'s output head with a `TrimmedHead` over `kept` (before quantizing, so
    that the smaller head is quantized too)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot trim an output head of type {type(head).__name__}")
    model.set_output_embeddings(TrimmedHead(head, kept))  # type: ignore[operator]
    # A tied head would be tied back to the input embeddings on a later `tie_weights`.
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False


def trimmed_size(model: nn.Module) -> int:
    """How many ids the model's head scores (its full width when untrimmed)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head, TrimmedHead):
        return len(head.kept)
    return int(getattr(head, "out_features", 0) or 0)
