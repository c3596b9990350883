# modelprep: API and batch workers share this image (command differs). CPU-only torch.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MODELPREP_DATA_DIR=/data

RUN apt-get update \
    && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the CPU wheel index: the default Linux wheel is a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml constraints.txt README.md ./
COPY service ./service
RUN pip install -c constraints.txt .

RUN useradd --create-home --uid 1000 modelprep \
    && mkdir -p /data \
    && chown modelprep /data
USER modelprep
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"

CMD ["modelprep", "serve", "--host", "0.0.0.0", "--port", "8000"]
