"""The trimmed draft vocabulary: which ids are kept, the head that scores them, its table, and
greedy output through the router with a trimmed (and quantized) draft."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.local import LocalTandem, build_local
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.runtime import vocab
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_DRAFT, ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.quantize import Int8WeightOnlyLinear
from cluster.runtime.runner import PagedModelRunner, build_runner
from cluster.runtime.tiny import END_OF_TEXT_ID
from tests.conftest import MAX_TOKENS, PROMPTS, TRIMMED_VOCAB, encode, models_cache


def test_the_most_frequent_ids_are_kept_ties_to_the_lower_id_and_eos_always() -> None:
    counts = [5, 0, 9, 5, 1, 0, 7]
    assert vocab.kept_token_ids(counts, 3).tolist() == [0, 2, 6]  # 9, 7, then 5 at id 0 not 3
    assert vocab.kept_token_ids(counts, 3, always=[5]).tolist() == [0, 2, 5, 6]
    assert vocab.kept_token_ids(counts, 100).tolist() == list(range(7))
    with pytest.raises(ValueError, match="at least one id"):
        vocab.kept_token_ids(counts, 0)


def test_a_trimmed_head_scores_the_kept_ids_exactly_and_nothing_else() -> None:
    torch.manual_seed(0)
    head = nn.Linear(8, 20, bias=False)
    kept = torch.tensor([1, 4, 5, 19])
    trimmed = vocab.TrimmedHead(head, kept)
    x = torch.randn(3, 2, 8)
    full, got = head(x), trimmed(x)
    assert got.shape == full.shape
    # The sub-matrix product may round differently from the full one in the last bit (the
    # kernel blocks the reduction by shape), so the kept scores agree within fp32 rounding;
    # losslessness needs only that the q sampled is the q sent, which the lines below check.
    torch.testing.assert_close(got[..., kept], full[..., kept], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[..., kept], trimmed.proj(x))  # the head's own scores, unaltered
    outside = torch.ones(20, dtype=torch.bool)
    outside[kept] = False
    assert torch.isinf(got[..., outside]).all() and (got[..., outside] < 0).all()
    q = got.softmax(-1)
    assert torch.equal(q[..., outside], torch.zeros_like(q[..., outside]))
    torch.testing.assert_close(q[..., kept], full[..., kept].softmax(-1))


def test_the_table_counts_the_corpus_once_and_is_reused(tmp_path: Path) -> None:
    tokenizer = load_model(ModelSpec(TINY_DRAFT, device="cpu")).tokenizer
    texts = ["aab", "ba"]
    counts, n_bytes, n_tokens = vocab.count_tokens(tokenizer, texts, 257)
    assert counts[ord("a")] == 3 and counts[ord("b")] == 2 and sum(counts) == 5
    assert (n_bytes, n_tokens) == (5, 5)
    path = tmp_path / "table.json"
    path.write_text(
        vocab.FrequencyTable(
            counts=(1,) * 257, source="s", corpus_bytes=1, corpus_tokens=1
        ).to_json()
    )
    assert vocab.load_or_build(path, tokenizer, 257).source == "s"  # current: read, not built
    stale = vocab.FrequencyTable((1,) * 257, "s", 1, 1, version=vocab.CORPUS_VERSION - 1)
    path.write_text(stale.to_json())
    rebuilt = vocab.load_or_build(path, tokenizer, 257)
    assert rebuilt.source != "s" and rebuilt.corpus_bytes > 1_000_000  # the stdlib's sources
    assert vocab.FrequencyTable.from_json(path.read_text()) == rebuilt


def test_corpus_is_the_stdlib_sources_and_the_reference_prose() -> None:
    files = vocab.stdlib_sources()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    first = next(vocab.corpus_texts())
    assert first.strip()  # pydoc_data's prose comes first
    assert sum(len(t) for t in vocab.corpus_texts(limit_bytes=1000)) < 1_000_000


def test_a_trimmed_tiny_draft_keeps_its_width_and_its_end_of_text(
    trimmed_tandem: LocalTandem,
) -> None:
    model = trimmed_tandem.draft.model
    head = model.get_output_embeddings()
    assert isinstance(head, vocab.TrimmedHead)
    assert vocab.trimmed_size(model) in (TRIMMED_VOCAB, TRIMMED_VOCAB + 1)
    assert END_OF_TEXT_ID in head.kept.tolist()
    assert trimmed_tandem.draft.vocab_size == trimmed_tandem.target.vocab_size  # full width
    assert ord("e") in head.kept.tolist() and ord("~") not in head.kept.tolist()


def test_trimming_and_quantizing_compose(vocab_cache: Path) -> None:
    with models_cache(vocab_cache):
        draft = load_model(
            ModelSpec(TINY_DRAFT, device="cpu", quantization="int8", trimmed_vocab=TRIMMED_VOCAB)
        )
    head = draft.model.get_output_embeddings()
    assert isinstance(head, vocab.TrimmedHead) and isinstance(head.proj, Int8WeightOnlyLinear)
    assert draft.vocab_size == 257
    # Asking for every id trims nothing.
    with models_cache(vocab_cache):
        full = load_model(ModelSpec(TINY_DRAFT, device="cpu", trimmed_vocab=1000))
    assert not isinstance(full.model.get_output_embeddings(), vocab.TrimmedHead)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_trimmed_draft_is_batched_by_the_paged_runner(
    vocab_cache: Path, quantization: str
) -> None:
    """Its -inf logits pass the runner's self-test: a trimmed draft batches its sessions."""
    spec = ModelSpec(
        TINY_DRAFT, device="cpu", quantization=quantization, trimmed_vocab=TRIMMED_VOCAB
    )
    with models_cache(vocab_cache):
        draft = load_model(spec)
    assert isinstance(build_runner(draft, kv_cache_bytes=1 << 20), PagedModelRunner)


def test_only_the_drafter_may_be_trimmed() -> None:
    with pytest.raises(InvalidArgumentError, match="trimmed_vocab must be >= 0"):
        ModelSpec(TINY_DRAFT, trimmed_vocab=-1)
    for side in ("router", "verifier"):
        with pytest.raises(InvalidArgumentError, match=f"{side}.trimmed_vocab"):
            TandemConfig(**{side: ReplicaGroupConfig(trimmed_vocab=100)})  # type: ignore[arg-type]
    config = TandemConfig(drafter=ReplicaGroupConfig(trimmed_vocab=100))
    assert config.pair().draft.trimmed_vocab == 100 and config.pair().target.trimmed_vocab == 0
    qwen = TandemConfig.from_dict({"models": {"preset": "qwen-coder"}})
    assert qwen.pair().target.trimmed_vocab == 0  # the target is never trimmed


@pytest.mark.slow
def test_a_trimmed_draft_keeps_greedy_output_exact(
    trimmed_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Lockstep rounds: every token goes through a posted block, so the trimmed draft's blocks
    # are verified. On a running session a drafter slowed by a busy host can have all its
    # blocks arrive after the target alone took their tokens (905 drafted, 0 accepted, seen
    # in CI), which says nothing about the trimmed vocabulary.
    monkeypatch.setattr(trimmed_tandem.router, "verifier_advances", False)
    drafted = accepted = 0
    for prompt in PROMPTS:
        for pipelined in (False, True):
            request = GenerationRequest(encode(trimmed_tandem, prompt), MAX_TOKENS, draft_tokens=4)
            result = trimmed_tandem.router.generate(request, pipelined=pipelined)
            assert result.tokens == target_only[prompt], (prompt, pipelined)
            drafted += result.stats.num_drafted
            accepted += result.stats.num_accepted
    assert drafted > 0 and accepted > 0


@pytest.mark.slow
def test_a_trimmed_and_quantized_draft_keeps_greedy_output_exact(
    vocab_cache: Path, target_only: dict[str, tuple[int, ...]]
) -> None:
    pair = resolve_pair("tiny", device="cpu")
    draft = dataclasses.replace(pair.draft, quantization="int8", trimmed_vocab=TRIMMED_VOCAB)
    with models_cache(vocab_cache):
        tandem = build_local(dataclasses.replace(pair, draft=draft))
    try:
        drafted = 0
        for prompt in PROMPTS:
            request = GenerationRequest(encode(tandem, prompt), MAX_TOKENS, draft_tokens=4)
            result = tandem.router.generate(request, pipelined=True)
            assert result.tokens == target_only[prompt], prompt
            drafted += result.stats.num_drafted
        assert drafted > 0
    finally:
        tandem.router.close()
