"""The connections to Redis of every process (API, worker, reaper, CLI; its own and Celery's), which follow a failover.

A managed Redis (ElastiCache, Memorystore, Sentinel behind a DNS name) fails over by promoting a replica and moving
its endpoint to it; a connection opened before still reaches the old primary, now a replica, which answers every write
`READONLY`. redis-py takes that for the command's own error and keeps the connection: every API request that writes
(a rate limit, a job) answered 500 for as long as the process lived. Here that answer closes the connection and is
raised as a `ConnectionError`: the command is sent once more on a new connection, to whatever the endpoint names now,
and what still fails is the outage every caller already handles (503 with Retry-After in the API, a retry in a
worker). Only a write is refused there, and refused before it takes effect, so sending it again is safe. Celery's
broker connections do the same (`BrokerTransport`; not a `socket://` broker's, whose class kombu fixes), and what
still fails is Celery's lost connection (its consumer connects again, a publish is retried by its retry policy): a
worker waiting for a message had its BRPOP ended by the failover and exited ("Unrecoverable error"), to be started
again by whatever supervises it. The broker connections of workers and the reaper also wait for a primary that
takes writes when they connect (`await_primary_s`, the transport option): while the endpoint still names the demoted
one, Celery connected, was refused and connected again, logging ~7 errors a second, and an ack cut off then was lost.

A primary that refuses writes for now is met the same way (`Unwritable`): full at its `maxmemory` (OOM) or unable to
save to disk (MISCONF). Its refusal was a command's own error: every API request answered 500 (its rate limit
writes), and each Celery worker exited "Unrecoverable error" at its next ack, again at every start while it lasted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
from redis import Redis
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import (
    ConnectionError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
)
from redis.retry import Retry

log = logging.getLogger(__name__)


class FailedOver(ConnectionError):
    """The server this connection reaches is a replica now: a failover moved the primary elsewhere."""


class Unwritable(ConnectionError):
    """The primary refuses writes for now: full at its `maxmemory` (noeviction), or unable to save to disk."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where} {reason}: it refuses writes")
        self.reason = reason


def connect(url: str, **options: Any) -> Redis:
    """A client of `url` (`redis://`, `rediss://`, `unix://`) whose connections follow a failover; `options` are
    redis-py's (timeouts, health checks)."""
    kind = parse_url(url).get("connection_class", Connection)
    return Redis.from_url(url, connection_class=_FOLLOWING[kind], retry=_once_more(), **options)


def _once_more() -> Retry:
    # one more try for a failover alone: other connection errors keep the callers' own handling and timing
    return Retry(NoBackoff(), 1, supported_errors=(FailedOver,))


def demoted(error: ResponseError) -> bool:
    """Whether `error` says its server became a replica: a write refused (as itself, or inside a script's error, which
    Redis 6 wraps), a blocking command ended by the change, or a read refused while it syncs with its new primary
    (MASTERDOWN, where `replica-serve-stale-data` is off)."""
    text = str(error)
    refused = isinstance(error, ReadOnlyError) or text.startswith("READONLY ") or "-READONLY " in text
    syncing = isinstance(error, MasterDownError) or "-MASTERDOWN " in text
    return refused or syncing or (text.startswith("UNBLOCKED ") and "master -> replica" in text)


def unwritable(error: ResponseError) -> str | None:
    """Why `error` says its server takes no writes for now (as itself, or inside a script's error), else None."""
    text = str(error)
    if isinstance(error, OutOfMemoryError) or text.startswith("OOM ") or "-OOM " in text:
        return "is full (maxmemory)"
    if text.startswith("MISCONF ") or "-MISCONF " in text:
        return "cannot save to disk (MISCONF)"
    return None


class _FollowsFailover:
    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ResponseError as error:
            refused = unwritable(error)
            if not demoted(error) and refused is None:
                raise
            # closed either way: replies of a transaction's other commands may still be on the way
            self.disconnect()  # type: ignore[attr-defined]
            where = self._host_error()  # type: ignore[attr-defined]
            if refused is not None:
                raise Unwritable(where, refused) from error
            raise FailedOver(f"{where} is a replica now (a failover)") from error


class _Tcp(_FollowsFailover, Connection):
    pass


class _Tls(_FollowsFailover, SSLConnection):
    pass


class _Unix(_FollowsFailover, UnixDomainSocketConnection):
    pass


_FOLLOWING = {Connection: _Tcp, SSLConnection: _Tls, UnixDomainSocketConnection: _Unix}


class _AwaitsPrimary(_FollowsFailover):
    """A connection that, given `await_primary_s`, connects to a writable primary only: one that reaches a replica (the
    endpoint still names the demoted primary) or a full one connects again every `_POLL_S` until it can write there,
    for that long at most. For the broker of workers and the reaper: an API request would rather be told to come back
    (503)."""

    _POLL_S = 0.25

    def __init__(self, *args: Any, await_primary_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.await_primary_s = await_primary_s

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is not None or not self.await_primary_s:  # type: ignore[attr-defined]
            return super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        deadline, said = time.monotonic() + self.await_primary_s, False
        while True:
            super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
            unfit = self._unfit()
            if unfit is None:
                return
            self.disconnect()  # type: ignore[attr-defined]
            where = self._host_error()  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                # not a FailedOver: the one retry it gets would wait as long again
                raise ConnectionError(f"{where} {unfit}: still so after {self.await_primary_s} s")
            if not said:
                log.warning("%s %s: waiting up to %.0f s for it to take writes", where, unfit, self.await_primary_s)
                said = True
            time.sleep(self._POLL_S)

    def _unfit(self) -> str | None:
        """Why the server cannot take a worker's writes now (a replica, full), as its ROLE and a write of a key that
        expires at once say; None where neither is allowed here (an ACL, a proxy): each command will say."""
        try:
            self.send_command("ROLE")  # type: ignore[attr-defined]
            role = self.read_response()
            if (role[0].decode() if isinstance(role[0], bytes) else role[0]) in ("slave", "replica"):
                return "is a replica (a failover)"
        except ResponseError:  # ROLE not allowed (a restricted user): the write says
            pass
        try:
            self.send_command("SET", "vsrq:writable-probe", 1, "PX", 1)  # type: ignore[attr-defined]
            self.read_response()
        except FailedOver:
            return "is a replica (a failover)"
        except Unwritable as refused:
            return refused.reason
        except ResponseError:  # the probe's key not allowed: each command will say
            return None
        return None


class _BrokerTcp(_AwaitsPrimary, Connection):
    pass


class _BrokerTls(_AwaitsPrimary, SSLConnection):
    pass


class _BrokerQoS(kombu_redis.QoS):
    """An ack (or reject) that a failover or an outage cut off still frees the message's place: a solo worker, allowed
    one unacknowledged message, took no other for good (a trial: every worker busy at a failover), its consumer never
    told its connection was lost. The message stays in the broker's unacked index, given again after the visibility
    timeout (and dropped then: its job ended)."""

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except (ConnectionError, TimeoutError):
            kombu_virtual.QoS.ack(self, delivery_tag)
            raise

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue)
        except (ConnectionError, TimeoutError):
            kombu_virtual.QoS.ack(self, delivery_tag)
            raise


class _BrokerChannel(kombu_redis.Channel):
    connection_class, connection_class_ssl = _BrokerTcp, _BrokerTls
    QoS = _BrokerQoS

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params = {**super()._connparams(asynchronous), "retry": _once_more()}  # an ack, a publish: as the job store's
        if issubclass(params["connection_class"], _AwaitsPrimary):
            params["await_primary_s"] = float(self.connection.client.transport_options.get("await_primary_s", 0))
        return params


class BrokerTransport(kombu_redis.Transport):
    """kombu's Redis transport on connections that follow a failover: what the failover refuses or ends is a lost
    connection (in kombu's `connection_errors`), which Celery's consumer and publishers connect again after."""

    Channel = _BrokerChannel
