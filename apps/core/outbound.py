"""Requests the plane makes on a tenant's behalf, to addresses a tenant chose (a single sign-on issuer and
its endpoints, a gateway deployment's api_base): one guarded client for all of them.

A tenant admin must not be able to point the plane at what only the plane can reach: its own API,
PostgreSQL and Redis on loopback, a cloud's metadata service on link-local, the private network it runs
in. So every connection is checked where it is made, after DNS resolution and on every redirect (each
hop opens its own connection): an address that is not globally routable (loopback, link-local, private,
shared, reserved, multicast, unspecified; IPv4-mapped IPv6 forms judged as their IPv4 address) or that is
one of the plane's own addresses is refused, unless the provider allows its range with
KLIQUE_OUTBOUND_ALLOW (CIDRs, for self-hosted models on a private network). The connection goes to the
address that was checked, never to a second resolution of the name, so a name that resolves to a public
address once and to loopback the next time (DNS rebinding) gains nothing. Decimal, hex and short IPv4
forms ("2130706433", "0x7f.1") are resolved by the system like any name and judged by what they mean.

Proxies from the environment are not used: the check is on the address the plane connects to.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_REDIRECTS = 3


class OutboundRefused(httpx.TransportError):
    """A request to an address the plane does not call for tenants; the message says which and why.
    `unresolved`: the name did not resolve (it may later; nothing was refused for what it is)."""

    def __init__(self, message: str, *, unresolved: bool = False) -> None:
        super().__init__(message)
        self.unresolved = unresolved


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(cidr, strict=False) for cidr in settings.KLIQUE_OUTBOUND_ALLOW]


@functools.lru_cache(maxsize=1)
def _own_addresses(names: tuple[str, ...]) -> frozenset[IPAddress]:
    """The addresses the plane's own names resolve to (its base domain and extra hosts), once a process."""
    found: set[IPAddress] = set()
    for name in names:
        try:
            infos = socket.getaddrinfo(name.lstrip("."), None)
        except (OSError, UnicodeError):
            continue
        found.update(_plain(ipaddress.ip_address(info[4][0])) for info in infos)
    return frozenset(found)


def _plain(address: IPAddress) -> IPAddress:
    """IPv4-mapped and IPv4-compatible IPv6 forms, judged as the IPv4 address they carry."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def why_refused(address: IPAddress) -> str | None:
    """Why the plane does not connect to `address` for a tenant, or None when it may."""
    plain = _plain(address)
    if any(plain in network for network in _allowed_networks()):
        return None
    if plain in _own_addresses(tuple(settings.ALLOWED_HOSTS)):
        return f"{plain} is the control plane's own address"
    for kind, refused in (
        ("loopback", plain.is_loopback),
        ("link-local (cloud metadata lives there)", plain.is_link_local),
        ("unspecified", plain.is_unspecified),
        ("multicast", plain.is_multicast),
        ("private", plain.is_private),
        ("not globally routable", not plain.is_global),
    ):
        if refused:
            return f"{plain} is {kind}"
    return None


def _refusal(host: str, why: str) -> OutboundRefused:
    return OutboundRefused(
        f"{host} cannot be reached from Klique: {why}. Tenant endpoints must be public addresses; the "
        "provider can allow a private range for self-hosted services (KLIQUE_OUTBOUND_ALLOW)."
    )


def _checked(host: str, infos: Iterable[tuple[Any, ...]]) -> str:
    """The first address of a resolution, if every address of it may be called (a name that resolves to
    one public and one private address is refused: the system could pick either)."""
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not addresses:
        raise OutboundRefused(f"{host} does not resolve to any address.", unresolved=True)
    for address in addresses:
        why = why_refused(address)
        if why:
            raise _refusal(host, why)
    return str(addresses[0])


def check_host(host: str, port: int = 443) -> str:
    """The address to connect to for `host`, or OutboundRefused (also for a name that does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise OutboundRefused(f"{host} does not resolve: {error}.", unresolved=True) from None
    return _checked(host, infos)


def check_url(url: str) -> str:
    """Refuse a URL that is not http(s) or whose host may not be called; the address it resolves to."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundRefused(f"{url[:200]!r} is not an http:// or https:// address.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise OutboundRefused(f"{url[:200]!r} has no valid port.") from None
    return check_host(parts.hostname, port)


def check_secure_url(url: str, *, why: str) -> str:
    """A URL a tenant sets for the plane (or its agents) to send to: refused as check_url refuses, and
    also unless it is https, but for a range the provider allowed (KLIQUE_OUTBOUND_ALLOW), where plain
    http is taken (a self-hosted service on a private network). `why` says what crosses it."""
    address = check_url(url)
    allowed = any(_plain(ipaddress.ip_address(address)) in network for network in _allowed_networks())
    if urlsplit(url).scheme != "https" and not allowed:
        raise OutboundRefused(f"{url[:100]!r} must use https: {why}.")
    return address


class _GuardedBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self.inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        address = check_host(host, port)
        return self.inner.connect_tcp(address, port, timeout, local_address, socket_options)

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        raise OutboundRefused("Tenant requests do not use Unix sockets.")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _GuardedAsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self.inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            raise OutboundRefused(f"{host} does not resolve: {error}.", unresolved=True) from None
        address = _checked(host, infos)
        return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise OutboundRefused("Tenant requests do not use Unix sockets.")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def _guard(transport: httpx.HTTPTransport | httpx.AsyncHTTPTransport) -> None:
    """Put the check under the transport's connection pool: every connection it opens is checked, and
    made to the checked address; TLS still verifies the name asked for. (httpx offers no other way to give
    its pool a network backend than its pool's attribute.)"""
    pool = transport._pool
    inner = pool._network_backend
    if isinstance(inner, httpcore.AsyncNetworkBackend):
        pool._network_backend = _GuardedAsyncBackend(inner)
    else:
        pool._network_backend = _GuardedBackend(inner)


def client(*, timeout: float = 10.0, follow_redirects: bool = False) -> httpx.Client:
    """A synchronous client for tenant-chosen addresses."""
    transport = httpx.HTTPTransport(trust_env=False)
    _guard(transport)
    return httpx.Client(
        transport=transport,
        timeout=timeout,
        follow_redirects=follow_redirects,
        max_redirects=MAX_REDIRECTS,
        trust_env=False,
    )


def async_client(**options: Any) -> httpx.AsyncClient:
    """An asynchronous client for tenant-chosen addresses (the gateway's upstreams)."""
    transport = httpx.AsyncHTTPTransport(trust_env=False, limits=options.pop("limits", httpx.Limits()))
    _guard(transport)
    return httpx.AsyncClient(transport=transport, trust_env=False, **options)
