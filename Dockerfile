# The control plane, its API and the rank runtime (launcher + example job), on the CPU.
#
#   docker build -t elastic-controlplane .
#   docker run --rm elastic-controlplane --help
#
# One image for every role of docker-compose.yml: `migrate`, `serve`, `api`, `run`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CPU build of PyTorch first (its own layer: large, and rarely changes). The default index
# would bring the CUDA build, gigabytes the CPU never uses.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY controlplane/ controlplane/
COPY rank_runtime/ rank_runtime/
COPY migrations/ migrations/
# Not editable: the packages (with the page's static files and the migrations) go into
# site-packages; torch is already satisfied. The image runs the control plane too: the server
# extra (a trainer-only image would install `.` alone).
RUN pip install '.[server]' \
    && python -c "import controlplane.web, migrations; print('installed')"

# The example training job and the deployment helpers (health checks, the trainer's wrapper).
COPY examples/ examples/
COPY deploy/healthcheck.py deploy/trainer.sh deploy/

# Never root. The launcher writes its fault markers under /tmp.
RUN useradd --create-home --uid 10001 --user-group elastic \
    && chmod 0755 deploy/trainer.sh
USER elastic

# Control plane rendezvous (TCPStore), API, Prometheus metrics of the control plane.
EXPOSE 29400 8080 9464
ENTRYPOINT ["elasticctl"]
CMD ["--help"]
