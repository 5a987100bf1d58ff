"""In-process Tandem: load a model pair and wire drafter, verifier and router together.

The transport is a direct method call: `InProcess` makes a plain `Drafter`, `SuffixDrafter`
or `Verifier` one of the router's ports, each call the component's `submit_*` future waited on
as waits (no thread of the router's waits). Everything else (router loop, sessions,
acceptance) is the code the distributed service runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from transformers import PreTrainedTokenizerBase

from cluster.presets import ModelPair
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.generation import Decode
from cluster.routing.router import Router, RouterOptions
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits, answer
from cluster.runtime.advance import Advance
from cluster.runtime.audit import Replay
from cluster.runtime.constraint import grammar_tokenizer_of
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.predraft import PreDraft
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig, NgramConfig, SuffixConfig
from drafter.drafter import Drafter
from drafter.suffix import SuffixDrafter
from verifier.config import VerifierConfig
from verifier.verifier import Verifier


class InProcess:
    """A plain component in this process as the router's port (`cluster.routing.ports`): a
    drafter's or a verifier's calls, as waits over its futures. A verifier's running session
    reports to the request's `SessionEvents` from the engine thread."""

    def __init__(self, component: Any) -> None:
        self.component = component

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        advance: Advance | None = None,
        events: SessionEvents | None = None,
        **options: Any,
    ) -> Waits[int]:
        if advance is not None:
            assert events is not None, "a running session reports to its events"
            options.update(advance=advance, sink=events.report)
        opening = self.component.submit_open(session_id, prompt_tokens, sampling, seed, **options)
        return (yield from answer(opening))

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        return (yield from answer(self.component.submit_draft(*args)))

    def predraft(self, *args: Any, **kwargs: Any) -> Waits[list[PreDraft]]:
        submit = getattr(self.component, "submit_predraft", None)
        if submit is None:
            raise InvalidArgumentError("this drafter does not pre-draft")
        return (yield from answer(submit(*args, **kwargs)))

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        events.answer(post_id, self.component.submit_verify(session_id, block, defer_bonus))

    def close_session(self, session_id: str) -> Waits[bool]:
        return (yield from answer(self.component.submit_close(session_id)))

    def reference(self, *args: Any, **kwargs: Any) -> Replay:
        replay: Replay = self.component.reference(*args, **kwargs)
        return replay


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
    verifier_advances: bool = True,
) -> LocalTandem:
    """Load both models of `pair` and connect them in this process. `predraft_fan_out`: the
    router's default for requests that do not set theirs (0: no pre-drafting); `suffix`: a
    suffix drafter asked before the drafter (None, or not enabled: none);
    `verifier_advances`: the router's option of that name."""
    target = load_model(pair.target)
    draft = load_model(pair.draft)
    if draft.vocab_size > target.vocab_size:
        raise InvalidArgumentError(
            f"draft vocabulary ({draft.vocab_size}) is larger than the target's "
            f"({target.vocab_size}): the pair must share a tokenizer"
        )
    verifier = Verifier(target, verifier_config)
    drafter = Drafter(draft, drafter_config)
    router = local_router(
        verifier,
        drafter,
        target,
        suffix=SuffixDrafter(suffix) if suffix is not None and suffix.enabled else None,
        ngram=prompt_lookup,
        draft_length=draft_length,
        predraft_fan_out=predraft_fan_out,
        verifier_advances=verifier_advances,
    )
    return LocalTandem(router, drafter, verifier, target.tokenizer, target, draft)


def local_router(
    verifier: Verifier,
    drafter: Drafter | None,
    target: LoadedModel,
    suffix: SuffixDrafter | None = None,
    **options: Unpack[RouterOptions],
) -> Router:
    """A router over an in-process verifier and drafter (and `suffix`, if given), decoding
    with `target`'s tokenizer, with `options` (`RouterOptions`): how tests and tools build
    another router over the components of a `LocalTandem`."""
    options.setdefault("decode_special", text_decoder(target.tokenizer, skip_special_tokens=False))
    options.setdefault(
        "grammar_tokenizer", grammar_tokenizer_of(target.tokenizer, target.eos_token_ids)
    )
    return Router(
        InProcess(verifier),
        None if drafter is None else InProcess(drafter),
        text_decoder(target.tokenizer),
        target.eos_token_ids,
        suffix=None if suffix is None else InProcess(suffix),
        **options,
    )
