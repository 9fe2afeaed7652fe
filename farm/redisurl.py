"""The forms FARM_REDIS_URL takes: a Redis URL, or the address of a Redis behind Sentinels."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from farm.errors import BadParameter

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
FORM = "redis+sentinel://[:password@]host1:port1,host2:port2/service_name[/db]"


@dataclass(frozen=True)
class SentinelAddress:
    """Where the Sentinels of one monitored Redis answer, its name there, and the database."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def check(url: str) -> None:
    """Refuse a FARM_REDIS_URL of no form the farm's clients take (BadParameter)."""
    if is_sentinel(url):
        parse_sentinel(url)
        return
    if urlsplit(url).scheme not in PLAIN_SCHEMES:
        raise BadParameter(
            f"FARM_REDIS_URL {url!r} is not redis://, rediss://, unix:// or {FORM}", url=url
        )


def parse_sentinel(url: str) -> SentinelAddress:
    """The parts of a ``redis+sentinel://`` URL; BadParameter names what is wrong."""

    def bad(why: str) -> BadParameter:
        # the password stays out of the message
        shown = url if "@" not in url else f"{SENTINEL_SCHEME}://***@{url.rsplit('@', 1)[1]}"
        return BadParameter(f"FARM_REDIS_URL {shown!r} {why}; the form is {FORM}", form=FORM)

    if not is_sentinel(url):
        raise bad("is not a Sentinel address")
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    password: str | None = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        if not auth.startswith(":") or len(auth) < 2:
            raise bad("has credentials other than ':password'")
        password = unquote(auth[1:])
    hosts, _, path = rest.partition("/")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad(f"names the Sentinel {item!r}, which is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise bad("names no service (the name the Sentinels monitor)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise bad("has a database that is not a number")
    db = int(parts[1]) if len(parts) == 2 else 0
    return SentinelAddress(tuple(sentinels), unquote(parts[0]), db, password)
