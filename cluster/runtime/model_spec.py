"""What model to load and how (`ModelSpec`), and the names a spec may use.

Plain data, validated when built, no I/O and no torch: a config names its models with specs
(`cluster.presets`, `cluster.config`), and reading one must not load torch or a model.
`cluster.runtime.models.load_model` loads a spec; `cluster.runtime.quantize` applies its
quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim_source import SIM_SCHEME, SimSource

TINY_SCHEME = "tiny://"
TINY_TARGET = TINY_SCHEME + "target"
TINY_DRAFT = TINY_SCHEME + "draft"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Weight and compute dtypes a model loads in (`cluster.runtime.models.DTYPES` maps each to its
torch dtype)."""
AUTO_DEVICE = "auto"
QUANTIZATIONS = ("none", "int8", "int8-dynamic", "int4")
"""Weight quantizations a model can be loaded with."""


def check_quantization(quantization: str) -> None:
    """Raises ValueError on an unknown quantization (callers turn it into their own error)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """What to load. Validated when built; loads nothing."""

    source: str
    """Hub id, local folder, `.gguf` file path, or `tiny://target` / `tiny://draft`."""
    dtype: str = "float32"
    """Weight and compute dtype: float32, bfloat16 or float16."""
    device: str = AUTO_DEVICE
    """`auto` (CUDA when present, else CPU), `cpu`, `cuda` or `cuda:N`."""
    quantization: str = "none"
    """`none`; `int8`: int8 weights per output channel for the Linear layers; `int8-dynamic`
    (CPU): activations quantized too, the rest in float32; `int4`: int4 weights in groups of
    input channels (a self-draft: the target's own copy). Drafts only: see
    `cluster.runtime.quantize`."""
    trimmed_vocab: int = 0
    """Score only this many most frequent token ids (0: all); the logits keep their width,
    -inf elsewhere. Drafts only: see `cluster.runtime.vocab`."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise InvalidArgumentError("model source must not be empty")
        if self.dtype not in DTYPE_NAMES:
            raise InvalidArgumentError(
                f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        try:
            check_quantization(self.quantization)
        except ValueError as error:
            raise InvalidArgumentError(str(error)) from None
        if self.trimmed_vocab < 0:
            raise InvalidArgumentError(f"trimmed_vocab must be >= 0, got {self.trimmed_vocab}")
        if self.source.startswith(TINY_SCHEME) and self.source not in (TINY_TARGET, TINY_DRAFT):
            raise InvalidArgumentError(
                f"unknown tiny model {self.source!r}: use {TINY_TARGET} or {TINY_DRAFT}"
            )
        if self.source.startswith(SIM_SCHEME):
            try:
                SimSource.parse(self.source)
            except ValueError as error:
                raise InvalidArgumentError(str(error)) from None
            if self.quantization != "none" or self.trimmed_vocab:
                raise InvalidArgumentError(
                    "a simulated model takes no quantization and no trimmed vocabulary"
                )
        if self.device != AUTO_DEVICE and not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise InvalidArgumentError(
                f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
