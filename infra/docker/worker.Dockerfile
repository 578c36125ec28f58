# The GPU worker image: CUDA userspace from NVIDIA's base, PyPI's CUDA build of torch==2.13.0 (its CUDA libraries come
# as nvidia-* wheels; the driver comes from the host through the NVIDIA container runtime). Build from the repository
# root:
#   docker build -f infra/docker/worker.Dockerfile -t vsrq-worker .
FROM nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /venv && useradd --system --uid 10001 vsrq
ENV PATH=/venv/bin:$PATH
WORKDIR /app

COPY pyproject.toml infra/docker/requirements.py ./
RUN python requirements.py worker pyproject.toml > /tmp/requirements.txt && pip install -r /tmp/requirements.txt

COPY README.md Procfile ./
COPY api api
COPY client client
COPY storage storage
COPY worker worker
COPY infra infra
RUN pip install --no-deps .

USER vsrq
# weights are mounted, never baked in: /models/k6-vsr from `huggingface-cli download ... --local-dir`
ENV VSRQ_WORKER_MODEL=/models/k6-vsr VSRQ_WORKER_DEVICES=cuda:0 VSRQ_METRICS_PORT=9100 VSRQ_METRICS_HOST=0.0.0.0 \
    VSRQ_LOG_FORMAT=json HF_HUB_OFFLINE=1
EXPOSE 9100
# the Procfile's `worker`: one solo process per pipeline group, on the queue its model is served on
CMD ["sh", "-c", "exec celery -A worker.tasks worker --pool solo --concurrency 1 -Q ${VSRQ_WORKER_QUEUE:-vsrq.k6} -n ${HOSTNAME}@vsrq"]
