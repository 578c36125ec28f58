"""The SSRF guard for URLs users give us (webhook receivers, fetched inputs): the host must resolve only to public
addresses. By rule rather than by a list of bad ranges:

- IPv4: what Python calls global (not loopback, private, link-local incl. cloud metadata at 169.254.169.254, CGNAT,
  unspecified, documentation, benchmarking, reserved...), and not multicast;
- IPv6: inside 2000::/3, the only space routed as global unicast (so never ::/96 IPv4-compatible, ::ffff:0:0/96
  mapped, 64:ff9b::/96 and 64:ff9b:1::/48 NAT64, 100::/64, ULA, link-local, multicast), global by Python's table,
  and not one of the tunnels that carry an IPv4 address inside (6to4 2002::/16, Teredo 2001::/32), which would
  reach whatever that IPv4 address is.

Check at registration and again right before each connection, and connect to the address that was checked (DNS
can answer differently the second time). The error says which host was refused, never what it resolved to: that
would make the guard an oracle for internal DNS.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import certifi
import urllib3

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_TUNNELS = (ipaddress.ip_network("2002::/16"), ipaddress.ip_network("2001::/32"))  # 6to4, Teredo


class UnsafeUrl(ValueError):
    code = "unsafe_url"


class LookupUnavailable(OSError):
    """The host's name could not be resolved now: the resolver did not answer in the time given, said to try again
    (EAI_AGAIN: down or failing upstream), or has too many lookups outstanding. It may pass, unlike `UnsafeUrl`."""


def public_addresses(url: str, *, allow_loopback: bool = False, timeout_s: float | None = None) -> list[IPAddress]:
    """The addresses `url`'s host resolves to, all of them public; raises `UnsafeUrl` otherwise, and
    `LookupUnavailable` when the resolver cannot say now (within `timeout_s`; None: its own limits).

    `allow_loopback` (development only) lets a local receiver on 127.0.0.1 / ::1 through."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise UnsafeUrl("must be an absolute http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise UnsafeUrl("must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = _resolved(parts.hostname, port, timeout_s)
    except socket.gaierror as error:
        if error.errno == socket.EAI_AGAIN:
            raise LookupUnavailable(f"the resolver could not resolve {parts.hostname!r} now") from error
        raise UnsafeUrl(f"host {parts.hostname!r} cannot be resolved") from error
    except (ValueError, UnicodeError) as error:
        raise UnsafeUrl(f"host {parts.hostname!r} cannot be resolved") from error
    addresses = sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)
    for address in addresses:
        if allow_loopback and address.is_loopback:
            continue
        if not is_public(address):
            raise UnsafeUrl(f"host {parts.hostname!r} resolves to a non-public address")
    return addresses


# lookups whose callers stopped waiting still run until the resolver gives up: at most this many at once
_LOOKUPS = threading.BoundedSemaphore(32)


def _resolved(host: str, port: int, timeout_s: float | None) -> list[tuple]:
    """`getaddrinfo`, waited for at most `timeout_s`. It has no timeout of its own (the system resolver's can be tens
    of seconds), so it runs on a daemon thread that, when nobody waits any more, ends at the resolver's limits."""
    if timeout_s is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_s
    if timeout_s <= 0 or not _LOOKUPS.acquire(timeout=timeout_s):
        raise LookupUnavailable(f"{host!r} was not resolved in time")
    answer: list[list[tuple] | Exception] = []
    lookup = threading.Thread(target=_lookup, args=(host, port, answer), name=f"lookup {host}", daemon=True)
    try:
        lookup.start()
    except BaseException:  # no thread (the process at its limit): its place is not taken
        _LOOKUPS.release()
        raise
    lookup.join(max(0.0, deadline - time.monotonic()))
    if not answer:
        raise LookupUnavailable(f"{host!r} was not resolved within {timeout_s:.3g} s")
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def _lookup(host: str, port: int, answer: list[list[tuple] | Exception]) -> None:
    try:
        answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except Exception as error:  # handed to the caller's thread, which raises it
        answer.append(error)
    finally:
        _LOOKUPS.release()


def is_public(address: IPAddress) -> bool:
    """Whether `address` is one a user's URL may reach (the module's rule)."""
    if isinstance(address, ipaddress.IPv4Address):
        return address.is_global and not address.is_multicast
    return (
        address in _GLOBAL_UNICAST
        and address.is_global
        and not any(address in tunnel for tunnel in _TUNNELS)
    )


def pinned_pool(
    parts: SplitResult, address: IPAddress, ca_bundle: Path | None, timeout: urllib3.Timeout
) -> urllib3.HTTPSConnectionPool:
    """An HTTPS pool whose socket goes to `address` (one `public_addresses` checked) while SNI and the certificate
    check use the URL's host name: DNS is never asked again between the check and the connection."""
    return urllib3.HTTPSConnectionPool(**_pinned(parts, address, ca_bundle), timeout=timeout, retries=False)


def pinned_connection(
    parts: SplitResult, address: IPAddress, ca_bundle: Path | None, timeout_s: float
) -> urllib3.connection.HTTPSConnection:
    """`pinned_pool`'s one connection, for a caller that needs its socket (to cut an exchange at a deadline)."""
    return urllib3.connection.HTTPSConnection(**_pinned(parts, address, ca_bundle), timeout=timeout_s)


def _pinned(parts: SplitResult, address: IPAddress, ca_bundle: Path | None) -> dict[str, Any]:
    """Where a pinned pool or connection goes, and how it checks TLS: one place for both."""
    return {
        "host": str(address),
        "port": parts.port or 443,
        "server_hostname": parts.hostname,
        "assert_hostname": parts.hostname,
        "cert_reqs": "CERT_REQUIRED",
        "ca_certs": str(ca_bundle or certifi.where()),
    }


def request_target(parts: SplitResult) -> str:
    """The path and query to send on a pinned connection."""
    return urlunsplit(("", "", parts.path or "/", parts.query, ""))
