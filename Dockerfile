# Images per role (docker build --target ROLE), from one file:
#
#   controlplane  elasticctl serve, api, migrate, retention, creds: the server packages, no
#                 torch (the rendezvous store the control plane hosts is its own, in Python)
#   trainer       the launcher (elastic-run) and the example job: the rank runtime and torch,
#                 none of the server packages
#
#   docker build --target controlplane -t elastic-controlplane .
#   docker build --target trainer -t elastic-trainer:cpu .
#   docker build --target trainer -t elastic-trainer \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#
# The CUDA build of torch carries the CUDA libraries it needs; the node's driver comes in
# through the NVIDIA container runtime. For your own training image (NGC's PyTorch, say):
# `pip install elastic-controlplane` (no extra) beside your torch, and the launcher as its
# entry point; docs/deploy/kubernetes.md, "Images".
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Never root: both roles run as this user.
RUN useradd --create-home --uid 10001 --user-group elastic

# ---------------------------------------------------------------------------- control plane
FROM base AS controlplane

COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY controlplane/ controlplane/
COPY rank_runtime/ rank_runtime/
COPY migrations/ migrations/
# Not editable: the packages (with the page's static files and the migrations) go into
# site-packages.
RUN pip install '.[server]' \
    && python -c "import controlplane.web, migrations; print('installed')"
# The container health checks of compose and the readiness probe of Kubernetes.
COPY deploy/healthcheck.py deploy/

USER elastic
# Rendezvous store (leader), API, Prometheus metrics of the control plane.
EXPOSE 29400 8080 9464
ENTRYPOINT ["elasticctl"]
CMD ["--help"]

# ---------------------------------------------------------------------------- trainer
FROM base AS trainer

# PyTorch first (its own layer: large, and rarely changes). The CPU index by default; the
# default PyPI index would bring the CUDA build, gigabytes a CPU node never uses.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY controlplane/ controlplane/
COPY rank_runtime/ rank_runtime/
COPY migrations/ migrations/
# The trainer-only install: no server extra (tests/unit/test_trainer_imports.py).
RUN pip install . \
    && python -c "import rank_runtime.launcher_cli; print('installed')"
# The example training job and the launcher's wrapper (FAULTS -> --fault, for compose).
COPY examples/ examples/
COPY deploy/trainer.sh deploy/
RUN chmod 0755 deploy/trainer.sh

# The launcher writes its fault markers under /tmp.
USER elastic
ENTRYPOINT ["elastic-run"]
CMD ["--help"]
