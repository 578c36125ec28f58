# The API image, also run as the reaper and the webhook worker: the service without the model stack (no torch, no
# CUDA: about 300 MB instead of several GB), installed from infra/lock/api.txt (exact versions, hashes checked).
# Build from the repository root (infra/docker/api.Dockerfile.dockerignore says what it sees):
#   docker build -f infra/docker/api.Dockerfile -t vsrq-api:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/vsrq XDG_CACHE_HOME=/home/vsrq/.cache
WORKDIR /app
RUN useradd --system --uid 10001 --create-home --home-dir /home/vsrq vsrq

# dependencies first: a code change does not reinstall them
COPY infra/lock/api.txt /tmp/lock.txt
RUN pip install --require-hashes --no-deps -r /tmp/lock.txt

COPY . .
RUN pip install --no-deps .

USER vsrq
ENV VSRQ_BIND=0.0.0.0:8000 VSRQ_METRICS_HOST=0.0.0.0 VSRQ_LOG_FORMAT=json
EXPOSE 8000
# /healthz: Redis and the blob store answer (503 if not); the reaper and the webhook worker override it (compose.yaml)
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
# the Procfile's `web`; the reaper and the webhook worker override the command
CMD ["gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"]
