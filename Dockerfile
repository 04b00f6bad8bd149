# gradserver image: `gradserver coordinator` by default; `worker`, `launch`, `health` as commands.
#   docker build -t gradserver .                                   (CPU torch)
#   docker build -t gradserver:cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   (CUDA torch)
# CUDA torch wheels carry the CUDA runtime, so the slim base serves both; BASE_IMAGE can name
# another Python 3.11 image (for example one with NVIDIA's tools) when a host needs it.
ARG BASE_IMAGE=python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gradserver
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY proto ./proto
COPY common ./common
COPY server ./server
COPY worker ./worker
COPY .ci/install-runtime.sh ./install-runtime.sh
RUN PYTHON=/opt/gradserver/bin/python TORCH_INDEX_URL="${TORCH_INDEX_URL}" sh ./install-runtime.sh /src

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
