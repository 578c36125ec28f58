"""The SSRF guard, on literal addresses and names this machine resolves itself (no network needed)."""

from __future__ import annotations

import ipaddress

import pytest

from storage.ssrf import UnsafeUrl, public_addresses

REFUSED = [
    "https://127.0.0.1/hook",
    "https://localhost/hook",
    "https://10.1.2.3:8443/",
    "https://172.16.0.1/",
    "https://192.168.1.1/",
    "https://169.254.169.254/latest/meta-data",  # cloud metadata
    "https://100.64.0.1/",  # CGNAT
    "https://224.0.0.1/",  # multicast
    "https://0.0.0.0/",
    "https://[::1]/",
    "https://[fd00::1]/",  # ULA
    "https://[fe80::1]/",  # link-local
    "https://[::ffff:10.0.0.1]/",  # IPv4-mapped
    "https://[64:ff9b::a00:1]/",  # NAT64 of 10.0.0.1
    "https://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "https://user:pass@93.184.215.14/",  # credentials in the URL
    "ftp://93.184.215.14/",
    "https://host.invalid/",  # does not resolve
]


@pytest.mark.parametrize("url", REFUSED)
def test_refused(url):
    with pytest.raises(UnsafeUrl):
        public_addresses(url)


def test_public_addresses_pass_and_loopback_only_with_the_development_flag():
    assert public_addresses("https://93.184.215.14/hooks") == [ipaddress.ip_address("93.184.215.14")]
    assert public_addresses("https://[2606:4700::1111]:8443/") == [ipaddress.ip_address("2606:4700::1111")]
    assert public_addresses("https://127.0.0.1:9000/hook", allow_loopback=True) == [ipaddress.ip_address("127.0.0.1")]
    with pytest.raises(UnsafeUrl):
        public_addresses("https://10.0.0.1/", allow_loopback=True)
