"""Regenerate the Python code for the Tandem protos, or check that it is current.

    python -m protos.build           # rewrite protos/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m protos.build --check   # exit 1, listing drifted files, if they are stale

The generated files are committed, so importing `protos` needs neither grpcio-tools nor a build
step; `--check` (and tests/protos/test_generated.py) keeps them in step with the .proto files.

protoc runs with the repository root as its include path and the files named `protos/x.proto`,
so generated modules import each other as `from protos import x_pb2`. The output depends only
on the .proto files and the pinned grpcio-tools version, so it is byte-identical across runs.
"""

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "protos"
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")


def proto_files(root: Path = REPO_ROOT) -> list[Path]:
    """The .proto files under `root/protos`, sorted so protoc sees them in a fixed order."""
    return sorted((root / PACKAGE).glob("*.proto"))


def generated_files(root: Path) -> dict[str, Path]:
    """Generated files under `root/protos`, keyed by their path relative to `root`."""
    paths = (p for pattern in GENERATED_PATTERNS for p in (root / PACKAGE).glob(pattern))
    return {p.relative_to(root).as_posix(): p for p in sorted(paths)}


def generate(out_dir: Path, root: Path = REPO_ROOT) -> None:
    """Compile every .proto under `root/protos` into `out_dir/protos`.

    Raises RuntimeError if protoc fails; protoc itself prints the reason on stderr.
    """
    # Imported here: grpcio-tools is a dev dependency, and importing it appends its bundled
    # protos to sys.path, which nothing but this function should pay for.
    from grpc_tools import protoc

    protos = proto_files(root)
    if not protos:
        raise RuntimeError(f"no .proto files under {root / PACKAGE}")
    (out_dir / PACKAGE).mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("grpc_tools") / "_proto") as well_known:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}",
            # protoc names each file by its path under the -I that holds it (`protos/x.proto`),
            # so the absolute checkout path never reaches the output.
            *(str(p) for p in protos),
        ]
        status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc exited with status {status}")


def find_drift(root: Path = REPO_ROOT) -> list[str]:
    """Compare the generated files under `root/protos` with a fresh build of its .proto files.

    Returns one line per drifted file, `"<kind>: protos/<file>"` with kind `missing` (protoc
    makes it, it is not checked in), `extra` (checked in, protoc does not make it) or
    `different`; an empty list means the checked-in code is current.
    """
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root, root)
        fresh = generated_files(fresh_root)
        current = generated_files(root)
        drift = [f"missing: {name}" for name in fresh if name not in current]
        drift += [f"extra: {name}" for name in current if name not in fresh]
        drift += [
            f"different: {name}"
            for name in fresh
            if name in current and not filecmp.cmp(fresh[name], current[name], shallow=False)
        ]
    return sorted(drift, key=lambda line: line.split(": ", 1)[1])


def write_generated(root: Path = REPO_ROOT) -> list[str]:
    """Regenerate the code under `root/protos`, deleting generated files no .proto makes.

    Returns the names written, relative to `root`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root, root)
        fresh = generated_files(fresh_root)
        for name, path in generated_files(root).items():
            if name not in fresh:
                path.unlink()
        for name, path in fresh.items():
            shutil.copyfile(path, root / name)
    return list(fresh)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m protos.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the checked-in generated files are stale",
    )
    options = parser.parse_args(argv)
    try:
        return _check() if options.check else _write()
    except RuntimeError as error:
        # protoc has already printed the cause (file, line, message); a traceback adds nothing.
        print(f"error: {error}", file=sys.stderr)
        return 1


def _check() -> int:
    drift = find_drift()
    if drift:
        print("generated code is stale; run `python -m protos.build`:", file=sys.stderr)
        for line in drift:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("generated code is current")
    return 0


def _write() -> int:
    for name in write_generated():
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
