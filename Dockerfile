# modelprep: API and batch workers share this image (the command differs). CPU-only torch.
#
#   docker build -t modelprep:latest .
#   docker build --build-arg TORCH_PIP_ARGS="--find-links /path/seen/by/pip" ...   # mirrors, air gap
#
# Every Python dependency is installed at the exact version of constraints.txt (the lock that
# `make install` and CI use too). Two stages: the build stage owns pip's leftovers (build/,
# egg-info, wheels); the image gets only the virtual environment.
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
COPY pyproject.toml README.md ./
COPY service ./service
# No build isolation: the build backend is the pinned setuptools already installed with torch.
RUN pip install ${PIP_CA_PEM:+--cert /opt/pip-ca.pem} $PIP_ARGS -c constraints.txt \
        --no-build-isolation . \
    && pip check

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/modelprep/bin:$PATH \
    MODELPREP_DATA_DIR=/data
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
