"""Whether an address is free to serve on. gunicorn binds with SO_REUSEPORT (infra/gunicorn.conf.py: a restarted
master serves at once), which also lets a second server of the same user bind an address already served, the kernel
then splitting connections between two services: a plain bind first says whether someone holds it."""

from __future__ import annotations

import socket


def bind_error(host: str, port: int) -> OSError | None:
    """The error a plain bind of (host, port) meets (EADDRINUSE: another server holds it); None where it is free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no owner
            probe.bind(address)
    except OSError as error:
        return error
    return None
