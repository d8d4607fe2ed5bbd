"""Loopback-only HTTP services (the device's endpoint, the dashboard without a token): which addresses and
Host headers count as this machine.

Binding to 127.0.0.1 keeps other machines out, but not a web page in the user's own browser: by DNS
rebinding, evil.example.com can resolve to 127.0.0.1 and its scripts then reach the port as a same-origin
site. The browser still sends `Host: evil.example.com`, so a loopback service answers only requests whose
Host names this machine.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether a host name or address (IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_header_is_loopback(host_header: str | None) -> bool:
    """Whether an HTTP Host header ('127.0.0.1:8765', '[::1]:8080', 'localhost') names this machine."""
    if not host_header:
        return False
    host = host_header.strip()
    if host.startswith("["):  # [IPv6]:port
        if "]" not in host:
            return False
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.rsplit(":", 1)[0]
    return is_loopback(host)


def refused_host_message(host_header: str | None, service: str) -> str:
    """The one-line error a loopback service answers to a foreign Host header."""
    return (
        f"Host {host_header!r} refused: the {service} answers only loopback host names "
        "(localhost, 127.0.0.1, ::1), so that a web page cannot reach it by DNS rebinding"
    )
