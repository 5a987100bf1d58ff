"""Model loading: the tiny pair, local folders, and precise errors for bad specs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_DRAFT, TINY_TARGET, ModelSpec
from cluster.runtime.models import LoadedModel, load_model, load_tokenizer


def test_tiny_pair_shares_tokenizer_and_vocabulary(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    assert tiny_target.vocab_size == tiny_draft.vocab_size == tiny.VOCAB_SIZE
    assert tiny_target.eos_token_ids == {tiny.END_OF_TEXT_ID}
    assert tiny_draft.model.config.num_hidden_layers < tiny_target.model.config.num_hidden_layers
    text = "def f(x): return x ** 2  # é"
    ids = tiny_target.tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tiny_target.tokenizer.decode(ids) == text


def test_tiny_models_are_deterministic() -> None:
    a, b = tiny.build_target(), tiny.build_target()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(
        tiny.build_target(seed=1).lm_head.weight, tiny.build_target(seed=0).lm_head.weight
    )


def test_draft_agrees_often_but_not_always(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    """The pair must exercise both acceptance and rejection."""
    tokens = torch.tensor([list(b"def add(a, b):\n    return a + b\n\nprint(add(1, 2))")])
    with torch.inference_mode():
        target = tiny_target.model(tokens).logits.argmax(-1)
        draft = tiny_draft.model(tokens).logits.argmax(-1)
    agreement = (target == draft).float().mean().item()
    assert 0.4 < agreement < 0.98


def test_dtype_is_applied() -> None:
    loaded = load_model(ModelSpec(TINY_DRAFT, dtype="bfloat16", device="cpu"))
    assert loaded.model.dtype == torch.bfloat16


def test_local_folder_round_trip(tiny_target: LoadedModel, tmp_path: Path) -> None:
    tiny_target.model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelSpec(str(tmp_path), device="cpu"))
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded.model(tokens).logits, tiny_target.model(tokens).logits, atol=0, rtol=0
        )
    assert loaded.tokenizer.decode([104, 105]) == "hi"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(source=""), "must not be empty"),
        (dict(source=TINY_TARGET, dtype="float64"), "dtype"),
        (dict(source="tiny://huge"), "unknown tiny model"),
        (dict(source=TINY_TARGET, device="tpu"), "device"),
    ],
)
def test_bad_specs(spec: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ModelSpec(**spec)


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="GGUF file not found"):
        load_model(ModelSpec(str(tmp_path / "absent.gguf"), device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda() -> None:
    with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
        load_model(ModelSpec(TINY_TARGET, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_on_cuda() -> None:
    loaded = load_model(ModelSpec(TINY_TARGET, device="auto"))
    assert loaded.device.type == "cuda"


def test_tokenizer_alone_matches_the_models(tiny_target: LoadedModel, tmp_path: Path) -> None:
    loaded = load_tokenizer(ModelSpec(TINY_TARGET))
    assert loaded.eos_token_ids == tiny_target.eos_token_ids
    tiny_target.model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    from_folder = load_tokenizer(ModelSpec(str(tmp_path)))
    assert from_folder.eos_token_ids == tiny_target.eos_token_ids
    assert from_folder.tokenizer.encode("abc", add_special_tokens=False) == [97, 98, 99]
