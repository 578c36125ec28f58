"""The web app at `/`: a static page (api/static/: HTML, JS, CSS, no build step) that talks to the public API
with the key the person enters, exactly as any other client does. The page and its assets need no key; the key never
leaves the browser except in `Authorization` headers.
"""

from __future__ import annotations

from flask import Blueprint, Response

blueprint = Blueprint("web", __name__, static_folder="static", static_url_path="/web")

# The page loads only its own files; videos are shown from blob: URLs (fetched with the key, or the dropped file).
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@blueprint.get("/")
def index() -> Response:
    response = blueprint.send_static_file("index.html")
    response.headers.update({"Content-Security-Policy": _CSP, "Referrer-Policy": "no-referrer"})
    return response


@blueprint.after_request
def _revalidate(response: Response) -> Response:
    # A few small files: revalidated (ETag) on every load, so an upgraded service never runs yesterday's script.
    response.headers.update({"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
    return response
