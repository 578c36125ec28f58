"""GET /v1/models: the models this service serves, in OpenAI's list shape (as OpenAI-compatible servers answer it).

A model is a name clients put in `model` on create; each is served by the workers of one queue (its pipeline group).
What a worker actually ran is on each finished job (`output.model`); the quality tiers a model's jobs can run are
read from its queue's registered workers (storage/workers.py), so the web page offers no tier that would do nothing.
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, jsonify

from api.auth import admit_caller
from api.errors import ApiError
from api.schemas import QUALITIES
from api.services import services
from storage.workers import WorkerInfo, WorkerRegistry

blueprint = Blueprint("models", __name__)
blueprint.before_request(admit_caller)
STARTED = int(time.time())  # OpenAI's `created`: a configured name exists from the process's start


def _model(name: str, queue: str, workers: list[WorkerInfo]) -> dict[str, Any]:
    default = name == services().settings.default_model
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "vsrq", "queue": queue, "default": default,
            "qualities": _qualities(queue, workers)}  # fmt: skip


def _qualities(queue: str, workers: list[WorkerInfo]) -> list[str]:
    """The tiers the model's jobs can run as asked, by what its queue's workers registered (worker.signals): `high`
    where one of them runs it faster (not lanczos, nor a GPU without FP8 GEMMs: their `high` jobs run `lossless`, and
    say so). Every tier while none is registered, or one registered before workers said: not known."""
    said = [worker.qualities for worker in workers if worker.model and queue in worker.queues]
    if not said or None in said:
        return list(QUALITIES)
    return [tier for tier in QUALITIES if any(tier in qualities for qualities in said)]


def _workers() -> list[WorkerInfo]:
    svc = services()
    return WorkerRegistry(svc.redis, ttl_s=svc.settings.worker_ttl_s).list()


@blueprint.get("/v1/models")
def list_models() -> Response:
    workers = _workers()  # one registry read for the list
    models = services().settings.models.items()
    return jsonify(object="list", data=[_model(name, queue, workers) for name, queue in models])


@blueprint.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    queue = services().settings.models.get(model_id)
    if queue is None:
        raise ApiError(404, "model_not_found", f"Model {model_id!r} is not served here; GET /v1/models lists them.")
    return jsonify(_model(model_id, queue, _workers()))
