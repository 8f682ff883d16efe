"""Which webhook targets a project token holder may register: only global addresses (``ipaddress``'s
``is_global``, after DNS resolution: no loopback, private, link-local, carrier-grade NAT, documentation
or otherwise special-purpose address, nor an IPv6 form of one such as 6to4 ``2002:7f00:1::``), and not
the server itself, unless the operator allows it.

Webhooks make the server send requests on someone's behalf. An endpoint registered through the API or
the dashboard (a project token holder, or anyone when auth is off and the server listens beyond
loopback) is checked here when it is added and again before every delivery (its name may resolve
elsewhere by then); endpoints the operator configures (``--webhook``, ``GRADWATCH_WEBHOOK_URLS``, the
``gradwatch webhook`` CLI, which needs the database) are trusted as given. docs/deployment.md, "Threat
model", says who is trusted with what.

>>> check_target("https://hooks.slack.com/services/T/B/x", allow=(), resolve=lambda host, port: ["52.1.2.3"])
>>> check_target("http://127.0.0.1:8470/api/v1/alerts/1/ack", allow=(), resolve=lambda host, port: ["127.0.0.1"])
Traceback (most recent call last):
...
gradwatch.server.webhooks.targets.TargetRefused: url: 127.0.0.1 is a loopback address; webhooks may not target internal (non-global) addresses unless the operator allows them (GRADWATCH_WEBHOOK_ALLOW)
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Callable, Iterable, Optional, Sequence
from urllib.parse import urlsplit


class TargetRefused(ValueError):
    """The URL may not be a webhook target; the message says why and how an operator allows it."""


def _resolve(host: str, port: int) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


# IPv6 forms that carry an IPv4 address a router or the OS may deliver to: the IPv4 one is judged too
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_v4(ip: ipaddress._BaseAddress) -> Optional[ipaddress.IPv4Address]:
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:                # 2002:7f00:1:: is 6to4 for 127.0.0.1
        return ip.sixtofour
    if ip.teredo is not None:                   # (server, client): the client is the one reached
        return ip.teredo[1]
    if ip in _NAT64 or (ip in _V4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _kind(ip: ipaddress._BaseAddress) -> str:
    """'' for a global address; else what it is ("a loopback", "a shared (CGNAT)", "a non-global" ...).

    The test is ``is_global`` (IANA's special-purpose registries), not a list of private ranges: the
    carrier-grade NAT range 100.64.0.0/10 (100.100.100.200 is a cloud metadata address) is neither
    private nor global, and was let through by a private-range check.
    """
    inner = _embedded_v4(ip)
    if inner is not None:
        kind = _kind(inner)
        if kind:
            return f"an IPv6 form of {inner}, {kind}"
    for attr, word in (("is_loopback", "a loopback"), ("is_unspecified", "an unspecified"),
                       ("is_link_local", "a link-local"), ("is_private", "a private"),
                       ("is_multicast", "a multicast"), ("is_reserved", "a reserved")):
        if getattr(ip, attr):
            return word
    if ip.version == 4 and ip in _SHARED:
        return "a shared (carrier-grade NAT)"
    if not ip.is_global:
        return "a non-global"
    return ""


_SHARED = ipaddress.ip_network("100.64.0.0/10")


def _allowed(host: str, ip: ipaddress._BaseAddress, allow: Iterable[str]) -> bool:
    for entry in allow:
        entry = entry.strip()
        if not entry:
            continue
        if entry.lower() == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def own_addresses() -> set[str]:
    """This machine's addresses as its own name resolves them (the server itself, when bound widely)."""
    try:
        return set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return set()


def check_target(url: str, *, allow: Sequence[str] = (), resolve: Callable[[str, int], list[str]] = _resolve,
                 own: Callable[[], set[str]] = own_addresses) -> None:
    """Raise ``TargetRefused`` unless ``url`` may be a project's webhook target."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("url: credentials in the URL (user:password@host) are not accepted; "
                            "sign deliveries with a secret instead")
    host = parts.hostname or ""
    if not host:
        raise TargetRefused("url: no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise TargetRefused("url: the port is not a number from 0 to 65535") from None
    try:
        addresses = resolve(host, port)
    except OSError:
        raise TargetRefused(f"url: the host {host!r} does not resolve") from None
    mine = own()
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            raise TargetRefused(f"url: the host {host!r} resolves to {address!r}, not an IP address") from None
        if _allowed(host, ip, allow):
            continue
        kind = _kind(ip) or ("this server's own" if address in mine else "")
        if kind:
            raise TargetRefused(f"url: {address} is {kind} address; webhooks may not target internal "
                                f"(non-global) addresses unless the operator allows them (GRADWATCH_WEBHOOK_ALLOW)")
