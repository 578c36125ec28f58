"""Service configuration (Redis, SeaweedFS, gunicorn) and `infra.stack`, which starts the backing services."""
