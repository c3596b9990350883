# modelprep: API and batch workers share this image (the command differs). CPU-only torch.
#
#   docker build -t modelprep:latest .
#   docker build --build-arg TORCH_PIP_ARGS="--find-links /path/seen/by/pip" ...   # mirrors, air gap
#
# Every Python dependency is installed at the exact version of constraints.txt (the lock that
# `make install` and CI use too). Two stages: the build stage owns pip's leftovers (build/,
# egg-info, wheels); the image gets only the virtual environment. A third stage builds llama.cpp's
# tools and keeps its converter classes (the GGUF exporter runs and imports them), with the script
# `make install` runs; its layer depends only on that script and the pinned version (read in a
# stage of its own, so that a change elsewhere in service/shims/llama_cpp.py keeps the cache), so the
# minutes of compiling are cached until the pin moves. The dependency list is read the same way.
FROM python:3.11-slim AS pins
COPY service/shims/llama_cpp.py pyproject.toml /
RUN sed -n 's/^LLAMA_CPP_PYTHON_VERSION = "\(.*\)"$/\1/p' /llama_cpp.py > /llama-cpp-version \
    && test -s /llama-cpp-version \
    && python -c 'import tomllib; print(*tomllib.load(open("/pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
        > /requirements.txt

FROM python:3.11-slim AS llama-cpp

ARG PIP_CA_PEM=""
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
         cmake g++ make \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/pip \
    && if [ -n "$PIP_CA_PEM" ]; then \
         { cat /etc/ssl/certs/ca-certificates.crt; printf '%s\n' "$PIP_CA_PEM"; } > /opt/pip-ca.pem; \
       fi
COPY scripts/build_llama_cpp.sh /src/scripts/
COPY --from=pins /llama-cpp-version /src/
# the script fetches the sdist with `python3 -m pip`: the venv's, as the base may have no pip
RUN env PATH=/opt/pip/bin:$PATH MODELPREP_CACHE_HOME=/opt/cache \
        ${PIP_CA_PEM:+PIP_CERT=/opt/pip-ca.pem} \
        /src/scripts/build_llama_cpp.sh "$(cat /src/llama-cpp-version)" \
    && mv /opt/cache/llama.cpp/[0-9]* /opt/llama.cpp

FROM python:3.11-slim AS build

# Where torch comes from: the default Linux wheel on PyPI is a multi-GB CUDA build.
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# Extra pip options for every install (a package mirror: --index-url URL, --find-links URL).
ARG PIP_ARGS=""
# Extra CA certificates (PEM text) pip must trust, e.g. a TLS-inspecting proxy's; build stage only.
ARG PIP_CA_PEM=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/modelprep/bin:$PATH
RUN python -m venv /opt/modelprep \
    && if [ -n "$PIP_CA_PEM" ]; then \
         { cat /etc/ssl/certs/ca-certificates.crt; printf '%s\n' "$PIP_CA_PEM"; } > /opt/pip-ca.pem; \
       fi
WORKDIR /src
COPY constraints.txt ./
RUN pip install ${PIP_CA_PEM:+--cert /opt/pip-ca.pem} $PIP_ARGS $TORCH_PIP_ARGS \
        -c constraints.txt torch
# The dependencies alone: their list is read from pyproject.toml in the pins stage and copied
# here, so this layer depends on that list and constraints.txt only. A change to service/, or to
# pyproject's tool settings (lint, test, import contracts), reinstalls nothing but the service.
COPY --from=pins /requirements.txt /tmp/requirements.txt
RUN pip install ${PIP_CA_PEM:+--cert /opt/pip-ca.pem} $PIP_ARGS -c constraints.txt \
        -r /tmp/requirements.txt
COPY pyproject.toml README.md ./
COPY service ./service
# No build isolation: the build backend is the pinned setuptools already installed with torch.
# Then the one `gguf`: the gguf-py of the llama.cpp built above (scripts/install_gguf_py.sh).
# Its build backend (poetry-core) is fetched by pip in an isolated environment, which does not
# inherit `--cert`: the CA bundle goes through PIP_CERT, which every pip process reads.
COPY --from=llama-cpp /opt/llama.cpp/convert/gguf-py /src/gguf-py
COPY scripts/install_gguf_py.sh ./scripts/
RUN pip install ${PIP_CA_PEM:+--cert /opt/pip-ca.pem} $PIP_ARGS -c constraints.txt \
        --no-build-isolation --no-deps . \
    && env ${PIP_CA_PEM:+PIP_CERT=/opt/pip-ca.pem} \
         scripts/install_gguf_py.sh /opt/modelprep/bin/pip /src/gguf-py $PIP_ARGS \
    && pip check

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/modelprep/bin:$PATH \
    MODELPREP_DATA_DIR=/data \
    MODELPREP_LLAMA_CPP_DIR=/opt/llama.cpp/bin
# llama.cpp's tools use OpenMP (libgomp), which a slim Debian root lacks
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=llama-cpp /opt/llama.cpp /opt/llama.cpp
COPY --from=build /opt/modelprep /opt/modelprep
# uid 1000 owns /data: a host directory mounted there must be writable by uid 1000 (README)
RUN useradd --create-home --uid 1000 modelprep \
    && mkdir -p /data \
    && chown modelprep:modelprep /data
USER modelprep
WORKDIR /home/modelprep
VOLUME ["/data"]
EXPOSE 8000

# One probe for both roles: a worker's heartbeat file when it has one, else the API's /readyz.
# Workers import torch and transformers before they are ready: allow for it on small machines.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["modelprep", "healthcheck"]

CMD ["modelprep", "serve", "--host", "0.0.0.0", "--port", "8000"]
