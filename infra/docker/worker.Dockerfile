# The GPU worker image, installed from infra/lock/worker.txt: PyPI's build of torch 2.13.0, which is built for CUDA 13.0
# and brings CUDA's libraries as nvidia-* wheels (cuDNN, cuBLAS, NCCL...), so the base is a plain Python one: no second
# CUDA beside torch's. The driver comes from the host through the NVIDIA container toolkit: 580 or newer (CUDA 13.0).
# Build from the repository root (infra/docker/worker.Dockerfile.dockerignore says what it sees):
#   docker build -f infra/docker/worker.Dockerfile -t vsrq-worker:0.1.0 .
FROM python:3.11-slim-bookworm

# The toolkit mounts the driver into containers that ask for it (the CUDA base images set the same two)
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The non-root user's home and caches: compiled kernels (Inductor, Triton) and any hub file land on /cache, a volume
# worth keeping across restarts (a warm Inductor cache halves the first start's compile: infra/README.md)
ENV HOME=/home/vsrq XDG_CACHE_HOME=/cache HF_HOME=/cache/huggingface TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    TRITON_CACHE_DIR=/cache/triton
# Triton builds its small launcher modules with the machine's C compiler when torch.compile first runs
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home --home-dir /home/vsrq vsrq && mkdir /cache && chown vsrq /cache
WORKDIR /app

# dependencies first: a code change does not reinstall them
COPY infra/lock/worker.txt /tmp/lock.txt
RUN pip install --require-hashes --no-deps -r /tmp/lock.txt

COPY . .
RUN pip install --no-deps .

USER vsrq
# weights are mounted, never baked in: /models/k6-vsr from `hf download ... --local-dir`
ENV VSRQ_WORKER_MODEL=/models/k6-vsr VSRQ_WORKER_DEVICES=cuda:0 VSRQ_METRICS_PORT=9100 VSRQ_METRICS_HOST=0.0.0.0 \
    VSRQ_LOG_FORMAT=json HF_HUB_OFFLINE=1
EXPOSE 9100
VOLUME ["/cache"]
# /metrics answers from a thread of its own as soon as the worker starts, and while a job runs (a solo worker answers
# nothing else then); the start period covers the model's load and compilation
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/metrics', timeout=4)"]
# the Procfile's `worker`: one solo process per pipeline group, on the queue its model is served on
CMD ["sh", "-c", "exec celery -A worker.tasks worker --pool solo --concurrency 1 --without-gossip --without-mingle -Q ${VSRQ_WORKER_QUEUE:-vsrq.k6} -n ${HOSTNAME}@vsrq"]
