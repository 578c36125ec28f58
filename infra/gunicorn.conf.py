"""gunicorn settings for the API (`web` in the Procfile). Threads, not more processes: requests mostly wait on
Redis, S3 and the network, and an upload holds its thread for as long as the client takes to send the file."""

import os

bind = os.environ.get("VSRQ_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("VSRQ_WEB_WORKERS", "2"))
worker_class = "gthread"
threads = int(os.environ.get("VSRQ_WEB_THREADS", "8"))
timeout = 120  # a worker process silent this long is restarted; streaming requests keep it alive
graceful_timeout = 60
accesslog = "-"
errorlog = "-"
