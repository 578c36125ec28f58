"""The SSRF guard for URLs users give us (webhook receivers now; fetched inputs later): the host must resolve only
to public addresses. Loopback, private (RFC 1918), link-local (incl. cloud metadata at 169.254.169.254), CGNAT,
multicast, unspecified, documentation/benchmark ranges, IPv6 ULA and link-local, and IPv4 addresses hidden inside
IPv6 ones (mapped, NAT64, 6to4, Teredo) are all refused.

Check at registration and again right before each connection, and connect to the address that was checked (DNS
can answer differently the second time).
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import SplitResult, urlsplit, urlunsplit

import certifi
import urllib3

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class UnsafeUrl(ValueError):
    code = "unsafe_url"


def public_addresses(url: str, *, allow_loopback: bool = False) -> list[IPAddress]:
    """The addresses `url`'s host resolves to, all of them public; raises `UnsafeUrl` otherwise.

    `allow_loopback` (development only) lets a local receiver on 127.0.0.1 / ::1 through."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise UnsafeUrl("must be an absolute http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise UnsafeUrl("must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (ValueError, socket.gaierror, UnicodeError) as error:
        raise UnsafeUrl(f"host {parts.hostname!r} cannot be resolved") from error
    addresses = sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)
    for address in addresses:
        for candidate in _unwrapped(address):
            if allow_loopback and candidate.is_loopback:
                continue
            if not candidate.is_global or candidate.is_multicast:
                raise UnsafeUrl(f"host {parts.hostname!r} resolves to a non-public address ({address})")
    return addresses


def _unwrapped(address: IPAddress) -> list[IPAddress]:
    """The address and every IPv4 address embedded in it."""
    found: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped:
            found.append(address.ipv4_mapped)
        if address.sixtofour:
            found.append(address.sixtofour)
        if address.teredo:
            found.extend(address.teredo)
        if address in _NAT64:
            found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def pinned_pool(
    parts: SplitResult, address: IPAddress, ca_bundle: Path | None, timeout: urllib3.Timeout
) -> urllib3.HTTPSConnectionPool:
    """An HTTPS pool whose socket goes to `address` (one `public_addresses` checked) while SNI and the certificate
    check use the URL's host name: DNS is never asked again between the check and the connection."""
    return urllib3.HTTPSConnectionPool(
        str(address),
        parts.port or 443,
        server_hostname=parts.hostname,
        assert_hostname=parts.hostname,
        cert_reqs="CERT_REQUIRED",
        ca_certs=str(ca_bundle or certifi.where()),
        timeout=timeout,
        retries=False,
    )


def request_target(parts: SplitResult) -> str:
    """The path and query to send on a pinned connection."""
    return urlunsplit(("", "", parts.path or "/", parts.query, ""))
