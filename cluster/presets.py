"""Named target/draft model pairs, and how flags override them.

A preset names the pair; `--target`, `--draft`, `--dtype` and `--device` override parts of it.
Any Hugging Face hub id, local folder or GGUF file works as a source (see
`cluster.runtime.models`). `qwen-coder` is a model pack (`cluster.runtime.packs`): its sources
are the converted folders in the pack cache, the one of the requested dtype (bf16 by default;
float16 loads the fp32 folder and casts). Building a pair does no I/O; loading an unfetched pack
says how to fetch it.

Plain data: a pair is two `ModelSpec`s (`cluster.runtime.model_spec`) and a pack's folders come
from `cluster.runtime.pack_catalog`, so resolving a preset (as reading a config does) loads no
torch and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_DRAFT, TINY_TARGET, ModelSpec
from cluster.runtime.pack_catalog import PACK_DTYPES, PACKS, model_dir

DEFAULT_PRESET = "tiny"


@dataclass(frozen=True)
class ModelPair:
    """The target the output must match, and the draft model that proposes tokens for it."""

    target: ModelSpec
    draft: ModelSpec


@dataclass(frozen=True)
class Preset:
    """A named pair: fixed sources, or a model pack whose folder depends on the dtype."""

    default_dtype: str
    target: str = ""
    draft: str = ""
    pack: str | None = None
    draft_quantization: str = "none"
    """The draft's weights by default (`cluster.runtime.quantize`); the target's never."""
    draft_vocab: int = 0
    """The draft's trimmed vocabulary by default (`cluster.runtime.vocab`; 0: all ids)."""
    tool_parser: str = ""
    """The tool-call format its target writes (`cluster.api.tool_formats`), when not the one
    its chat template asks for ("": the template's)."""
    draft_role: str = "draft"
    """Which of the pack's models drafts: `draft`, or `target` for a self-draft (the target's
    own weights, quantized: `draft_quantization` must then not be `none`)."""

    def __post_init__(self) -> None:
        if self.draft_role not in ("draft", "target"):
            raise InvalidArgumentError(
                f"draft_role must be draft or target, got {self.draft_role!r}"
            )
        if self.draft_role == "target" and self.draft_quantization == "none":
            raise InvalidArgumentError("a self-draft is the target again unless it is quantized")

    def pair(self, dtype: str | None) -> ModelPair:
        chosen = dtype or self.default_dtype
        quantization, vocab = self.draft_quantization, self.draft_vocab
        if self.pack is None:
            return ModelPair(
                ModelSpec(self.target, dtype=chosen),
                ModelSpec(self.draft, dtype=chosen, quantization=quantization, trimmed_vocab=vocab),
            )
        pack = PACKS[self.pack]
        stored = chosen if chosen in PACK_DTYPES else "float32"
        return ModelPair(
            ModelSpec(str(model_dir(pack, "target", stored)), dtype=chosen),
            ModelSpec(
                str(model_dir(pack, self.draft_role, stored)),
                dtype=chosen,
                quantization=quantization,
                trimmed_vocab=vocab,
            ),
        )


PRESETS: dict[str, Preset] = {
    "tiny": Preset(default_dtype="float32", target=TINY_TARGET, draft=TINY_DRAFT),
    # int8 weight-only drafts: 84 ms/token against 129 in bf16 on one CPU thread, agreement
    # with the target unchanged, and batch-invariant (cluster.runtime.quantize); scoring the
    # 65,536 most frequent of 151,936 ids: ~69 ms/token, agreement 80.3% against 80.9%
    # (cluster.runtime.vocab; docs/models.md).
    # Simulated devices (cluster.runtime.sim; docs/simulated-device.md): the real path with the
    # forward pass replaced by modelled time. An 8B target on an H100 beside a 0.5B draft on
    # an A10G, the draft agreeing with the target's greedy choice at 0.8 (or 0.6). Their
    # vocabulary is 4,096 ids, not a real model's 32,000-150,000: building and scanning
    # vocabulary-wide rows is work a GPU does, and on the host it would be counted as the
    # system's own (64 rows and their argmax: ~0.2 ms a step, ~1 ms at 32,000 ids).
    "sim-h100-8b": Preset(
        default_dtype="float32",
        target="sim://target/h100-8b?vocab=4096",
        draft="sim://draft/a10g-0.5b?alpha=0.8&vocab=4096",
    ),
    "sim-h100-8b-a06": Preset(
        default_dtype="float32",
        target="sim://target/h100-8b?vocab=4096",
        draft="sim://draft/a10g-0.5b?alpha=0.6&vocab=4096",
    ),
    # A 70B target in FP8 on one H200 beside a 1B draft on an H100: a step of ~16 ms, where
    # the host is not the limit.
    "sim-h200-70b": Preset(
        default_dtype="float32",
        target="sim://target/h200-70b?vocab=4096",
        draft="sim://draft/h100-1b?alpha=0.8&vocab=4096",
    ),
    # No modelled time: whatever is measured is the system's own.
    "sim-instant": Preset(
        default_dtype="float32",
        target="sim://target/instant?vocab=4096",
        draft="sim://draft/instant?alpha=0.8&vocab=4096",
    ),
    # Qwen2.5-Coder-1.5B-Instruct's template asks for Hermes <tool_call> tags, but the model
    # writes its calls as fenced JSON: 10 of 10 tool-use prompts (docs/structured-outputs.md).
    "qwen-coder": Preset(
        default_dtype="bfloat16",
        pack="qwen-coder",
        draft_quantization="int8",
        draft_vocab=65536,
        tool_parser="json_fence",
    ),
    # Self-drafts: the target's own weights, quantized, draft for it (docs/models.md, "The
    # target's own weights as the draft"). On one CPU thread, against the bf16 target's 235.5
    # ms/token: int4 (groups of 32) 56.2 ms/token, greedy agreement 95.1%; int8 110.9 ms,
    # 97.9%; the 0.5B int8 draft over 65,536 ids 31.6 ms, 77.1%. End to end (4 prompts, 48
    # tokens): 10.3 tokens/s against 6.5 for the target alone. The full vocabulary is kept.
    "qwen-coder-self-int4": Preset(
        default_dtype="bfloat16",
        pack="qwen-coder",
        draft_role="target",
        draft_quantization="int4",
        tool_parser="json_fence",
    ),
    "qwen-coder-self-int8": Preset(
        default_dtype="bfloat16",
        pack="qwen-coder",
        draft_role="target",
        draft_quantization="int8",
        tool_parser="json_fence",
    ),
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
    pair = PRESETS[preset].pair(dtype)
    target_spec = replace(pair.target, source=target) if target else pair.target
    draft_spec = replace(pair.draft, source=draft) if draft else pair.draft
    if device is not None:
        target_spec = replace(target_spec, device=device)
        draft_spec = replace(draft_spec, device=device)
    return ModelPair(target=target_spec, draft=draft_spec)
