"""In-process Tandem: load a model pair and wire drafter, verifier and router together.

The transport is a direct method call: the plain `Drafter` and `Verifier` satisfy the router's
ports themselves. Everything else (router loop, sessions, acceptance) is the code the
distributed service runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from cluster.presets import ModelPair
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.generation import Decode
from cluster.routing.router import Router
from cluster.runtime.constraint import grammar_tokenizer_of
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel, load_model
from drafter.config import DrafterConfig, NgramConfig, SuffixConfig
from drafter.drafter import Drafter
from drafter.suffix import SuffixDrafter
from verifier.config import VerifierConfig
from verifier.verifier import Verifier


@dataclass
class LocalTandem:
    """A router over an in-process drafter and verifier, and the target's tokenizer."""

    router: Router
    drafter: Drafter
    verifier: Verifier
    tokenizer: PreTrainedTokenizerBase
    target: LoadedModel
    draft: LoadedModel


def text_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> Decode:
    """The router's decode function for a Hugging Face tokenizer: special tokens left out (the
    router's `decode`), or kept (its `decode_special`)."""

    def decode(token_ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    return decode


def build_local(
    pair: ModelPair,
    drafter_config: DrafterConfig | None = None,
    verifier_config: VerifierConfig | None = None,
    prompt_lookup: NgramConfig | None = None,
    draft_length: DraftLengthConfig | None = None,
    predraft_fan_out: int = 0,
    suffix: SuffixConfig | None = None,
) -> LocalTandem:
    """Load both models of `pair` and connect them in this process. `predraft_fan_out`: the
    router's default for requests that do not set theirs (0: no pre-drafting); `suffix`: a
    suffix drafter asked before the drafter (None, or not enabled: none)."""
    target = load_model(pair.target)
    draft = load_model(pair.draft)
    if draft.vocab_size > target.vocab_size:
        raise InvalidArgumentError(
            f"draft vocabulary ({draft.vocab_size}) is larger than the target's "
            f"({target.vocab_size}): the pair must share a tokenizer"
        )
    verifier = Verifier(target, verifier_config)
    drafter = Drafter(draft, drafter_config)
    router = Router(
        verifier,
        drafter,
        text_decoder(target.tokenizer),
        target.eos_token_ids,
        suffix=SuffixDrafter(suffix) if suffix is not None and suffix.enabled else None,
        ngram=prompt_lookup,
        draft_length=draft_length,
        predraft_fan_out=predraft_fan_out,
        decode_special=text_decoder(target.tokenizer, skip_special_tokens=False),
        grammar_tokenizer=grammar_tokenizer_of(target.tokenizer, target.eos_token_ids),
    )
    return LocalTandem(
        router=router,
        drafter=drafter,
        verifier=verifier,
        tokenizer=target.tokenizer,
        target=target,
        draft=draft,
    )
