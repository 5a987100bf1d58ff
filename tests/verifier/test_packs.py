"""Model packs: part discovery, assembly with checksums, idempotent fetch, preset paths; and,
where the qwen-coder pack is cached, the real pair decoding exactly like the target alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from cluster.presets import resolve_pair
from verifier.runtime import packs
from verifier.runtime.errors import InvalidArgumentError
from verifier.runtime.models import ModelSpec, load_model

PARTS = [b"first part|", b"second|", b"third and last"]


def fake_model(parts_dir: Path, data: list[bytes] = PARTS) -> packs.PackModel:
    """Part packages laid out as pip installs them: a module whose get_part_path names a file."""
    for index, chunk in enumerate(data, 1):
        module = parts_dir / f"fake_part{index}"
        (module / "data").mkdir(parents=True)
        (module / "data" / f"part{index:02d}.bin").write_bytes(chunk)
        (module / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{index:02d}.bin')\n"
        )
    whole = b"".join(PARTS)
    return packs.PackModel(
        role="draft", name="fake", package_prefix="fake-part", version="1.0",
        num_parts=len(data), size_bytes=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
    )  # fmt: skip


def test_parts_assemble_in_order_and_are_checked(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "parts")
    paths = packs.part_paths(model, tmp_path / "parts")
    assert [p.name for p in paths] == ["part01.bin", "part02.bin", "part03.bin"]
    messages: list[str] = []
    dest = tmp_path / "draft.gguf"
    packs.assemble(paths, dest, model.size_bytes, model.sha256, messages.append)
    assert dest.read_bytes() == b"".join(PARTS)
    assert len(messages) == 3 and "part 3/3" in messages[-1]
    messages.clear()
    packs.assemble(paths, dest, model.size_bytes, model.sha256, messages.append)
    assert messages == []  # already there: skipped


def test_corrupt_parts_are_refused(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "parts")
    paths = packs.part_paths(model, tmp_path / "parts")
    paths[1].write_bytes(b"SECOND|")  # same size, different bytes
    with pytest.raises(packs.PackError, match=r"draft\.gguf is corrupt"):
        packs.assemble(paths, tmp_path / "draft.gguf", model.size_bytes, model.sha256, print)
    assert not (tmp_path / "draft.gguf").exists()
    assert not (tmp_path / "draft.gguf.partial").exists()


def test_installed_parts_are_not_installed_again(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "parts")
    messages: list[str] = []
    packs.install_parts(model, tmp_path / "parts", messages.append)  # would call pip otherwise
    assert messages == []


def test_converted_pack_fetch_does_nothing(tmp_path: Path) -> None:
    pack = packs.PACKS["qwen-coder"]
    for model in pack.models:
        for dtype in packs.PACK_DTYPES:
            folder = packs.model_dir(pack, model.role, dtype, tmp_path)
            folder.mkdir(parents=True)
            (folder / packs.DONE_MARKER).write_text("x")
    messages: list[str] = []
    folders = packs.fetch(pack, messages.append, root=tmp_path)
    assert set(folders) == {f"{r}-{d}" for r in ("target", "draft") for d in packs.PACK_DTYPES}
    assert messages == [f"qwen-coder is ready in {tmp_path / 'qwen-coder'}"]


def test_preset_points_at_the_pack_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packs.CACHE_ENV, str(tmp_path))
    pair = resolve_pair("qwen-coder")
    assert pair.target.source == str(tmp_path / "qwen-coder" / "target-bfloat16")
    assert pair.target.dtype == "bfloat16"
    fp16 = resolve_pair("qwen-coder", dtype="float16")
    assert fp16.draft.source == str(tmp_path / "qwen-coder" / "draft-float32")
    with pytest.raises(InvalidArgumentError, match="tandem models fetch qwen-coder"):
        load_model(pair.target)


def test_missing_absolute_folder_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(ModelSpec(str(tmp_path / "nowhere")))


QWEN = packs.PACKS["qwen-coder"]
qwen_cached = all(
    packs.is_converted(packs.model_dir(QWEN, role, "float32")) for role in ("target", "draft")
)


@pytest.mark.slow
@pytest.mark.skipif(not qwen_cached, reason="qwen-coder pack not fetched (tandem models fetch)")
def test_real_pair_greedy_equals_the_target_alone() -> None:
    """fp32 Qwen2.5-Coder 1.5B with its 0.5B draft: Tandem's greedy tokens equal HF generate."""
    from cluster.local import build_local

    tandem = build_local(resolve_pair("qwen-coder", dtype="float32", device="cpu"))
    from cluster.routing.request import GenerationRequest

    ids = tuple(tandem.tokenizer.encode("def fibonacci(n):", add_special_tokens=False))
    result = tandem.router.generate(GenerationRequest(ids, 16, draft_tokens=4))
    with torch.inference_mode():
        reference = tandem.verifier._target.model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False
        )[0, len(ids) :]
    assert list(result.tokens) == reference.tolist()
    assert result.stats.num_accepted > 0
