"""Which addresses a webhook may reach: public ones only, unless the operator allows private.

The farm is a shared service: a member's hook must not make the farm call its own Redis, a
cloud metadata endpoint (169.254.169.254) or anything else on its private network. A host
name is resolved when the request is sent and every address it resolves to is checked
(``GuardedResolver``, the resolver the dispatcher's HTTP client connects with), so a name that
pointed somewhere public when the hook was made and points inward now is refused too.
"""

from __future__ import annotations

import ipaddress
import socket

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class AddressRefused(OSError):
    """The hook's host is (or resolves to) an address webhooks may not reach."""


def refusal(address: str, allow_private: bool) -> str:
    """Why a webhook may not go to ``address`` (an IP literal), or '' when it may."""
    try:
        ip: Address = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast:
        return f"{ip} is not an address a webhook can be sent to"
    if not allow_private and not ip.is_global:
        return (
            f"{ip} is a loopback, link-local or private address; webhooks go to public "
            "addresses only (an operator may allow private ones: FARM_WEBHOOK_ALLOW_PRIVATE=1)"
        )
    return ""


def literal(host: str) -> bool:
    """``host`` is an IP address, not a name (aiohttp connects to those without resolving)."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


class GuardedResolver(AbstractResolver):
    """The system resolver, keeping only the addresses ``refusal`` lets through; a name with
    none left fails with AddressRefused (the connection is never attempted)."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        allowed = [r for r in found if not refusal(r["host"], self.allow_private)]
        if not allowed:
            why = refusal(found[0]["host"], self.allow_private) if found else "no address"
            raise AddressRefused(f"{host} resolves to {why}")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
