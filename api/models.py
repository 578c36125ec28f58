"""GET /v1/models: the models this service serves, in OpenAI's list shape (as OpenAI-compatible servers answer it).

A model is a name clients put in `model` on create; each is served by the workers of one queue (its pipeline group).
What a worker actually ran is on each finished job (`output.model`).
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, jsonify

from api.auth import admit_caller
from api.errors import ApiError
from api.services import services

blueprint = Blueprint("models", __name__)
blueprint.before_request(admit_caller)
STARTED = int(time.time())  # OpenAI's `created`: a configured name exists from the process's start


def _model(name: str, queue: str) -> dict[str, Any]:
    default = name == services().settings.default_model
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "vsrq", "queue": queue, "default": default}


@blueprint.get("/v1/models")
def list_models() -> Response:
    return jsonify(object="list", data=[_model(name, queue) for name, queue in services().settings.models.items()])


@blueprint.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    queue = services().settings.models.get(model_id)
    if queue is None:
        raise ApiError(404, "model_not_found", f"Model {model_id!r} is not served here; GET /v1/models lists them.")
    return jsonify(_model(model_id, queue))
