# Two gradserver images from one Dockerfile, both non-root with ENTRYPOINT ["gradserver"]:
#   docker build --target coordinator -t gradserver-coordinator .
#       the coordinator (`gradserver coordinator` by default; `health` as a command): the base
#       install without torch or matplotlib, with a HEALTHCHECK on its gRPC port
#   docker build --target worker -t gradserver-worker .              (CPU torch)
#   docker build --target worker -t gradserver-worker:cuda --build-arg TORCH_VARIANT=cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   (CUDA torch)
#       the training worker (`gradserver worker` by default; `launch` and `coordinator` too): the
#       train extra. Without --target the build ends at this stage.
# The worker build fails unless the installed torch is the TORCH_VARIANT build (its version ends
# in +cpu, +cu128, ...), so a pip that picked another torch stops it instead of passing silently;
# the coordinator build fails if any torch came in (TORCH_VARIANT=none).
# Without a reachable torch index, put one torch wheel in docker/wheels/ and add
# --build-arg TORCH_WHEEL_DIR=docker/wheels (what `make docker-check` does with the local CPU wheel).
# CUDA torch wheels carry the CUDA runtime, so one base serves both. BASE_IMAGE can name another
# Debian-like image with Python 3.11, venv and useradd: `make docker-check` makes one with
# debootstrap where no registry can be reached.
# Stages in the order the classic builder (compose v1) needs: it builds every stage before the
# target, so the coordinator's stages come first and never wait for torch.
ARG BASE_IMAGE=python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VARIANT=cpu
ARG TORCH_WHEEL_DIR=

# The sources and an empty virtual environment, shared by both builds (one cached layer chain).
FROM ${BASE_IMAGE} AS sources
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/gradserver
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY proto ./proto
COPY common ./common
COPY server ./server
COPY worker ./worker
COPY torch_backend ./torch_backend
COPY train ./train
COPY cli ./cli
COPY .ci/install-runtime.sh .ci/check-torch.sh ./.ci/

# What every image runs as: an unprivileged user owning /runs.
FROM ${BASE_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin gradserver \
    && mkdir -p /runs && chown gradserver:gradserver /runs
ENV PATH=/opt/gradserver/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /runs

FROM sources AS build-coordinator
RUN PYTHON=/opt/gradserver/bin/python EXTRAS= TORCH_VARIANT=none sh .ci/install-runtime.sh /src

FROM runtime AS coordinator
COPY --from=build-coordinator /opt/gradserver /opt/gradserver
ENV GRADSERVER_BIND=0.0.0.0:50051
USER gradserver
EXPOSE 50051 9090
HEALTHCHECK --interval=5s --timeout=5s --start-period=10s --retries=3 \
    CMD ["gradserver", "health", "127.0.0.1:50051"]
ENTRYPOINT ["gradserver"]
CMD ["coordinator"]

FROM sources AS build-worker
ARG TORCH_INDEX_URL
ARG TORCH_VARIANT
ARG TORCH_WHEEL_DIR
# Only this stage reads the wheel folder, so the coordinator's build never depends on a wheel.
COPY docker/wheels ./docker/wheels
RUN PYTHON=/opt/gradserver/bin/python TORCH_INDEX_URL="${TORCH_INDEX_URL}" TORCH_VARIANT="${TORCH_VARIANT}" \
    TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR}" sh .ci/install-runtime.sh /src

FROM runtime AS worker
COPY --from=build-worker /opt/gradserver /opt/gradserver
USER gradserver
VOLUME ["/runs"]
ENTRYPOINT ["gradserver"]
CMD ["worker"]
