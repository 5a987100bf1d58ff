"""Load a causal LM and its tokenizer: a Hugging Face hub id, a local folder, a GGUF file, tiny
or simulated.

What to load and how (source, dtype, device, quantization, trimmed vocabulary) is a `ModelSpec`,
which lives in `cluster.runtime.model_spec` (plain data, checked when a config is read, without
torch); `load_model` loads one and returns a `LoadedModel`, and `load_tokenizer` its tokenizer.
Drafter and verifier both load through here, so a model means the same thing on either side.
Sources:

- `tiny://target`, `tiny://draft`: the random-weight test pair of `cluster.runtime.tiny` (no
  download);
- `sim://target/PROFILE`, `sim://draft/PROFILE?alpha=A`: a simulated device, its source parsed
  by `cluster.runtime.sim_source` and its model object built by `cluster.runtime.sim_model`
  (`cluster.runtime.sim`: modelled forward-pass time, cheap deterministic logits);
- a path ending in `.gguf`: a GGUF file, dequantised by transformers (needs the `gguf` package);
- an existing folder: a `save_pretrained` directory;
- anything else: a Hugging Face hub id (needs hub access).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cluster.runtime import sim, sim_model, tiny, vocab
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import AUTO_DEVICE, TINY_DRAFT, TINY_SCHEME, TINY_TARGET, ModelSpec
from cluster.runtime.quantize import compute_dtype, output_width, quantize_weights

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with what callers need to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's size: padded embeddings)."""
        return output_width(self.model)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation for this model."""
        return _eos_ids(self.model.generation_config, self.tokenizer)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A model's tokenizer and end-of-sequence ids, without its weights (for the router)."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]


def _eos_ids(
    generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase
) -> frozenset[int]:
    ids: set[int] = set()
    configured = None if generation_config is None else generation_config.eos_token_id
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_tokenizer(spec: ModelSpec) -> LoadedTokenizer:
    """The tokenizer of `spec` and the ids that end its generations; loads no weights."""
    if spec.source.startswith(TINY_SCHEME):
        return LoadedTokenizer(tiny.build_tokenizer(), frozenset({tiny.END_OF_TEXT_ID}))
    if spec.source.startswith(sim.SIM_SCHEME):
        vocab_size = sim.SimSource.parse(spec.source).vocab_size
        return LoadedTokenizer(
            sim_model.build_tokenizer(vocab_size), frozenset({sim.END_OF_TEXT_ID})
        )
    _check_local_path(spec)
    path = Path(spec.source).expanduser()
    if spec.source.endswith(".gguf"):
        if not path.is_file():
            raise InvalidArgumentError(f"GGUF file not found: {path}")
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return LoadedTokenizer(tokenizer, _eos_ids(None, tokenizer))
    source = str(path) if path.is_dir() else spec.source
    tokenizer = AutoTokenizer.from_pretrained(source)
    try:
        generation_config: GenerationConfig | None = GenerationConfig.from_pretrained(source)
    except OSError:
        generation_config = None  # the model ships none: the tokenizer's eos is all there is
    return LoadedTokenizer(tokenizer, _eos_ids(generation_config, tokenizer))


def resolve_device(name: str) -> torch.device:
    """The torch device for a spec's device string; `auto` picks CUDA when present."""
    if name == AUTO_DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def _load_weights(spec: ModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    dtype = DTYPES[spec.dtype]
    if spec.source == TINY_TARGET:
        return tiny.build_target(), tiny.build_tokenizer()
    if spec.source == TINY_DRAFT:
        return tiny.build_draft(), tiny.build_tokenizer()
    if spec.source.startswith(sim.SIM_SCHEME):
        source = sim.SimSource.parse(spec.source)
        simulated = sim_model.SimCausalLM.from_source(source)
        return simulated, sim_model.build_tokenizer(source.vocab_size)
    path = Path(spec.source).expanduser()
    if spec.source.endswith(".gguf"):
        if not path.is_file():
            raise InvalidArgumentError(f"GGUF file not found: {path}")
        folder, name = str(path.parent), path.name
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A folder or a hub id: transformers tells the two apart itself.
    model = AutoModelForCausalLM.from_pretrained(
        str(path) if path.is_dir() else spec.source, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec.source)
    return model, tokenizer


def _check_local_path(spec: ModelSpec) -> None:
    """An absolute path that does not exist is a missing folder, never a hub id: say so."""
    if not spec.source.startswith("/") or spec.source.endswith(".gguf"):
        return  # hub ids are relative; a GGUF file gets its own message when loaded
    if Path(spec.source).exists():
        return
    from cluster.runtime.pack_catalog import cache_root

    hint = ""
    path = Path(spec.source)
    if path.is_relative_to(cache_root()):
        pack = path.relative_to(cache_root()).parts[0]
        hint = f": fetch it with `tandem models fetch {pack}`"
    raise InvalidArgumentError(f"model folder {spec.source} does not exist{hint}")


def trim_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec) -> None:
    """Give `model` a head over its `spec.trimmed_vocab` most frequent ids (and its end of
    sequence ids), counted once per tokenizer and stored (`cluster.runtime.vocab`)."""
    width = output_width(model)
    if spec.trimmed_vocab >= width:
        return  # every id is kept: nothing to trim
    path = vocab.table_path(spec.source, tokenizer)
    table = vocab.load_or_build(path, tokenizer, width)
    eos = _eos_ids(model.generation_config, tokenizer)
    try:
        vocab.trim_output_head(model, vocab.kept_token_ids(table.counts, spec.trimmed_vocab, eos))
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load `spec` onto its device, in eval mode."""
    _check_local_path(spec)
    device = resolve_device(spec.device)
    model, tokenizer = _load_weights(spec)
    # Module.to moves and casts in place. It is called through nn.Module because transformers'
    # decorated override of `to` is opaque to type checkers.
    dtype = compute_dtype(spec.quantization, DTYPES[spec.dtype], device)
    torch.nn.Module.to(model, device=device, dtype=dtype)
    model.eval()
    if spec.trimmed_vocab:
        trim_vocab(model, tokenizer, spec)
    try:
        quantize_weights(model, spec.quantization, device)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None
    return LoadedModel(model=model, tokenizer=tokenizer, device=device)
