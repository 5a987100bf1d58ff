"""Named target/draft model pairs, and how flags override them.

A preset names the pair; `--target`, `--draft`, `--dtype` and `--device` override parts of it.
Any Hugging Face hub id, local folder or GGUF file works as a source (see `verifier.models`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from verifier.errors import InvalidArgumentError
from verifier.models import TINY_DRAFT, TINY_TARGET, ModelSpec

DEFAULT_PRESET = "tiny"


@dataclass(frozen=True)
class ModelPair:
    """The target the output must match, and the draft model that proposes tokens for it."""

    target: ModelSpec
    draft: ModelSpec


PRESETS: dict[str, ModelPair] = {
    "tiny": ModelPair(target=ModelSpec(TINY_TARGET), draft=ModelSpec(TINY_DRAFT)),
}


def resolve_pair(
    preset: str = DEFAULT_PRESET,
    target: str | None = None,
    draft: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> ModelPair:
    """The preset's pair with any given source, dtype or device put in its place."""
    if preset not in PRESETS:
        raise InvalidArgumentError(
            f"unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}"
        )
    pair = PRESETS[preset]
    target_spec = replace(pair.target, source=target) if target else pair.target
    draft_spec = replace(pair.draft, source=draft) if draft else pair.draft
    if dtype is not None:
        target_spec, draft_spec = (
            replace(target_spec, dtype=dtype),
            replace(draft_spec, dtype=dtype),
        )
    if device is not None:
        target_spec = replace(target_spec, device=device)
        draft_spec = replace(draft_spec, device=device)
    return ModelPair(target=target_spec, draft=draft_spec)
