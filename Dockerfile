# gradserver image: `gradserver coordinator` by default; `worker`, `launch`, `health` as commands.
#   docker build -t gradserver .                                   (CPU torch)
#   docker build -t gradserver:cuda --build-arg TORCH_VARIANT=cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   (CUDA torch)
# The build fails unless the installed torch is the TORCH_VARIANT build (its version ends in
# +cpu, +cu128, ...), so a pip that picked another torch stops it instead of passing silently.
# Without a reachable torch index, put one torch wheel in docker/wheels/ and add
# --build-arg TORCH_WHEEL_DIR=docker/wheels (what `make docker-check` does with the local CPU wheel).
# CUDA torch wheels carry the CUDA runtime, so one base serves both. BASE_IMAGE can name another
# Debian-like image with Python 3.11, venv and useradd: `make docker-check` makes one with
# debootstrap where no registry can be reached.
ARG BASE_IMAGE=python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VARIANT=cpu
ARG TORCH_WHEEL_DIR=

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL
ARG TORCH_VARIANT
ARG TORCH_WHEEL_DIR
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/gradserver
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY proto ./proto
COPY common ./common
COPY server ./server
COPY worker ./worker
COPY train ./train
COPY cli ./cli
COPY docker/wheels ./docker/wheels
COPY .ci/install-runtime.sh .ci/check-torch.sh ./.ci/
RUN PYTHON=/opt/gradserver/bin/python TORCH_INDEX_URL="${TORCH_INDEX_URL}" TORCH_VARIANT="${TORCH_VARIANT}" \
    TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR}" sh .ci/install-runtime.sh /src

FROM ${BASE_IMAGE} AS runtime
COPY --from=build /opt/gradserver /opt/gradserver
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin gradserver \
    && mkdir -p /runs && chown gradserver:gradserver /runs
ENV PATH=/opt/gradserver/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GRADSERVER_BIND=0.0.0.0:50051
USER gradserver
WORKDIR /runs
VOLUME ["/runs"]
EXPOSE 50051 9090
HEALTHCHECK --interval=5s --timeout=5s --start-period=10s --retries=3 \
    CMD ["gradserver", "health", "127.0.0.1:50051"]
ENTRYPOINT ["gradserver"]
CMD ["coordinator"]
