# The API image, also run as the reaper and the webhook worker: the service without the model stack (no torch, no
# CUDA: about 300 MB instead of several GB). Build from the repository root:
#   docker build -f infra/docker/api.Dockerfile -t vsrq-api .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --system --uid 10001 vsrq

# dependencies first: a code change does not reinstall them
COPY pyproject.toml infra/docker/requirements.py ./
RUN python requirements.py api pyproject.toml > /tmp/requirements.txt && pip install -r /tmp/requirements.txt

COPY README.md Procfile ./
COPY api api
COPY client client
COPY storage storage
COPY worker worker
COPY infra infra
RUN pip install --no-deps .

USER vsrq
ENV VSRQ_BIND=0.0.0.0:8000 VSRQ_METRICS_HOST=0.0.0.0 VSRQ_LOG_FORMAT=json
EXPOSE 8000
# the Procfile's `web`; the reaper and the webhook worker override the command
CMD ["gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"]
