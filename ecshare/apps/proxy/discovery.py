"""Membership at run time: backends join and leave through registration and DNS discovery.

A backend is a member while at least one source holds it: the command line ("static"), a
registration (`POST /v1/members`, `DELETE /v1/members`, with the admin key; without one
configured the routes do not exist), or a DNS name (`discover`: every address the name
resolves to, each on the given port, which is what a Kubernetes headless Service gives).
When its last source lets go, it leaves its pool and the item directory forgets what it
held. A new member is out of rotation until its first health check passes, and its item
feed is watched from the start.

Every join, leave and refusal is counted (`stats`) and logged. A DNS lookup that fails
changes nothing (counted): only a successful answer without an address removes members.

With several proxy workers (`--workers N`), a registration reaches whichever worker
answers it, which relays it to the supervisor (`relay`, set by `link`); the supervisor
sends the registered set to every worker, in one order, and to a worker that (re)starts
before it serves (`shared`). Every worker watches the same DNS names and the same static
members itself, and subscribes to every member's item feed itself, so every worker's
directory hears the same events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from ecshare.apps.proxy.backends import DECODE, ENCODER, PREFILL_DECODE, BackendPool, describe
from ecshare.apps.proxy.config import ProxyConfig, split_target
from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.feeds import DirectoryFeeds, events_address
from ecshare.apps.proxy.tenants import holds_key
from ecshare.control import load_keypair, load_public_key

log = logging.getLogger(__name__)

STATIC: Final = "static"
REGISTERED: Final = "registered"
MAX_MEMBERS_PER_ROLE: Final = 1024
MAX_URL_CHARS: Final = 2048

Resolver = Callable[[str], Awaitable[list[str]]]
# Register (True) or unregister a member everywhere; whether it joined (left) this pool.
Relay = Callable[[bool, str, str], Awaitable[bool]]


class Member(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A registration's body."""

    role: Literal["encoder", "prefill_decode", "decode"]
    url: str


def base_url(url: str) -> str | None:
    """`url` as a backend's base URL (http/https, a host, no path or credentials), or None."""
    if len(url) > MAX_URL_CHARS:
        return None
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return None
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.user:
        return None
    if parsed.path not in ("", "/") or parsed.query_string or parsed.fragment:
        return None
    return url.rstrip("/")


class Membership:
    """Which backends are members, by which sources; joins and leaves pools and the feeds."""

    def __init__(
        self,
        pools: Mapping[str, BackendPool],
        *,
        health_timeout_s: float,
        directory: ItemDirectory | None = None,
        feeds: DirectoryFeeds | None = None,
        events_port: int | None = None,
        server_keys: Mapping[str, bytes | None] | None = None,
    ) -> None:
        self._pools = pools
        self._health_timeout_s = health_timeout_s
        self.directory = directory if directory is not None else ItemDirectory()
        self._feeds = feeds
        self._events_port = events_port
        self._server_keys = dict(server_keys or {})
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sources: dict[tuple[str, str], set[str]] = {}
        self._stats = dict.fromkeys(
            ("joined", "left", "refused", "unauthorized", "dns_failures"), 0
        )
        self.relay: Relay | None = None  # where registrations go (another worker's sake)

    async def start(
        self,
        session: aiohttp.ClientSession,
        discovery: Mapping[str, tuple[str, int]] | None = None,
        *,
        interval_s: float = 10.0,
        resolve: Resolver | None = None,
    ) -> None:
        """In the proxy's loop: take the pools' backends as members from the command line,
        watch their feeds, and start discovering each role's (NAME, PORT) of `discovery`."""
        self._session = session
        for role, pool in self._pools.items():
            for backend in pool.backends:
                self._sources.setdefault((role, backend.url), set()).add(STATIC)
                self._watch(role, backend.url)
        loop = asyncio.get_running_loop()
        for role, (name, port) in (discovery or {}).items():
            self._tasks.append(
                loop.create_task(
                    discover(
                        self,
                        role,
                        name,
                        port,
                        interval_s=interval_s,
                        resolve=resolve or resolve_addresses,
                    ),
                    name=f"ecshare-discover {role}",
                )
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._feeds is not None:
            await self._feeds.close()

    def serves(self, role: str) -> bool:
        """Whether `role` is one of this proxy's (decode only with --prefill/--decode)."""
        return role in self._pools

    async def join(self, role: str, url: str, source: str) -> bool:
        """Hold `url` in `role` by `source`; True when it is new to the pool."""
        pool = self._pools[role]
        sources = self._sources.get((role, url))
        if sources is not None:
            sources.add(source)
            return False
        if len(pool) >= MAX_MEMBERS_PER_ROLE:
            self._stats["refused"] += 1
            log.warning("%s %s refused: %d members already", role, url, len(pool))
            return False
        backend = pool.add(url)
        if backend is None:  # in the pool, but not ours to track: leave it be
            return False
        self._sources[(role, url)] = {source}
        self._stats["joined"] += 1
        log.info("%s %s joined (%s)", role, url, source)
        self._watch(role, url)
        if self._session is not None:
            await pool.check_one(self._session, backend, self._health_timeout_s)
        return True

    def leave(self, role: str, url: str, source: str) -> bool:
        """Let go of `url` by `source`; True when that was its last source and it left."""
        sources = self._sources.get((role, url))
        if sources is None or source not in sources:
            return False
        sources.discard(source)
        if sources:
            return False
        del self._sources[(role, url)]
        self._pools[role].remove(url)
        if self._feeds is not None:
            self._feeds.unwatch(url)
        else:
            self.directory.unwatch(url)
        self._stats["left"] += 1
        log.info("%s %s left (%s); its items are forgotten", role, url, source)
        return True

    async def register(self, role: str, url: str) -> bool:
        """A registration (`/v1/members`): here, or in every worker through `relay`."""
        if self.relay is not None:
            return await self.relay(True, role, url)
        return await self.join(role, url, REGISTERED)

    async def unregister(self, role: str, url: str) -> bool:
        if self.relay is not None:
            return await self.relay(False, role, url)
        return self.leave(role, url, REGISTERED)

    async def apply_registered(
        self, wanted: set[tuple[str, str]]
    ) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """Make the registered members `wanted` (the supervisor's set); which joined and
        which left the pools."""
        held = {(role, url) for role, urls in self.held_by(REGISTERED).items() for url in urls}
        left = {m for m in sorted(held - wanted) if self.leave(*m, REGISTERED)}
        adding = sorted((role, url) for role, url in wanted - held if role in self._pools)
        joined = await asyncio.gather(*(self.join(role, url, REGISTERED) for role, url in adding))
        return {m for m, ok in zip(adding, joined, strict=True) if ok}, left

    def held_by(self, source: str) -> dict[str, set[str]]:
        """The URLs `source` holds, per role."""
        out: dict[str, set[str]] = {role: set() for role in self._pools}
        for (role, url), sources in self._sources.items():
            if source in sources:
                out[role].add(url)
        return out

    def members(self) -> list[dict[str, Any]]:
        return [
            {"role": role, "url": url, "sources": sorted(sources)}
            for (role, url), sources in sorted(self._sources.items())
        ]

    def stats(self) -> dict[str, int]:
        """Counters: joined, left, refused, unauthorized, dns_failures; the directory's and
        its feeds' under `directory_*` and `feeds_*`."""
        out = dict(self._stats)
        out.update({f"directory_{k}": v for k, v in self.directory.stats().items()})
        if self._feeds is not None:
            out.update({f"feeds_{k}": v for k, v in self._feeds.stats().items()})
        return out

    def count(self, what: str) -> None:
        self._stats[what] += 1

    def _watch(self, role: str, url: str) -> None:
        if role == DECODE:  # routing chooses decode by load alone: its items are no hint
            return
        if self._feeds is None or self._events_port is None:
            self.directory.watch(url, encoder=role == ENCODER)
            return
        try:
            address = events_address(url, self._events_port)
            self._feeds.watch(
                url, address, encoder=role == ENCODER, server_key=self._server_keys.get(role)
            )
        except ValueError as exc:  # a key or address that cannot be used: no hints from it
            log.warning("item directory: cannot watch %s: %s", url, exc)


async def resolve_addresses(name: str) -> list[str]:
    """Every address `name` resolves to (A and AAAA records), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def discover(
    membership: Membership,
    role: str,
    name: str,
    port: int,
    *,
    interval_s: float,
    resolve: Resolver = resolve_addresses,
    scheme: str = "http",
) -> None:
    """Keep `role`'s members from `name` equal to its addresses on `port`, every
    `interval_s`, until cancelled."""
    source = f"dns:{name}:{port}"
    while True:
        try:
            addresses = await resolve(name)
        except asyncio.CancelledError:
            raise
        except (OSError, UnicodeError) as exc:
            membership.count("dns_failures")
            log.warning(
                "discovery: %s did not resolve (%s); members unchanged", name, describe(exc)
            )
        else:
            wanted = {
                f"{scheme}://[{a}]:{port}" if ":" in a else f"{scheme}://{a}:{port}"
                for a in addresses
            }
            held = membership.held_by(source)[role]
            for url in sorted(wanted - held):
                await membership.join(role, url, source)
            for url in sorted(held - wanted):
                membership.leave(role, url, source)
        await asyncio.sleep(interval_s)


MemberAction = Callable[[Member], Awaitable[dict[str, bool]]]


def member_routes(membership: Membership, admin_key: str) -> list[web.RouteDef]:
    """`GET`, `POST` and `DELETE /v1/members`, each needing `Authorization: Bearer <admin_key>`."""

    def authorized(request: web.Request) -> bool:
        ok = holds_key(request.headers.get("Authorization", ""), admin_key)
        if not ok:
            membership.count("unauthorized")
            log.warning("members: refused a request without the admin key from %s", request.remote)
        return ok

    def admin(
        action: Callable[[web.Request], Awaitable[web.Response]],
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            if not authorized(request):
                return web.json_response({"error": "admin key required"}, status=401)
            return await action(request)

        return handler

    def with_member(action: MemberAction) -> Callable[[web.Request], Awaitable[web.Response]]:
        """`action` on the member the body names; 400 for a body that names none."""

        async def handler(request: web.Request) -> web.Response:
            try:
                member = msgspec.json.decode(await request.read(), type=Member)
            except msgspec.DecodeError as exc:
                membership.count("refused")
                return web.json_response({"error": f"bad member: {exc}"}, status=400)
            url = base_url(member.url)
            if url is None:
                membership.count("refused")
                return web.json_response(
                    {"error": "url must be a base URL such as http://host:8000"}, status=400
                )
            if not membership.serves(member.role):
                membership.count("refused")
                return web.json_response(
                    {"error": f"this proxy has no {member.role} instances (--prefill/--decode)"},
                    status=400,
                )
            return web.json_response(await action(Member(member.role, url)))

        return admin(handler)

    async def listing(_request: web.Request) -> web.Response:
        # Which worker answered: its directory is its own (each subscribes to every feed).
        listed = {"members": membership.members(), "stats": membership.stats()}
        return web.json_response({**listed, "worker": os.getpid()})

    async def register(member: Member) -> dict[str, bool]:
        return {"joined": await membership.register(member.role, member.url)}

    async def unregister(member: Member) -> dict[str, bool]:
        return {"left": await membership.unregister(member.role, member.url)}

    return [
        web.get("/v1/members", admin(listing)),
        web.post("/v1/members", with_member(register)),
        web.delete("/v1/members", with_member(unregister)),
    ]


def membership_from_config(config: ProxyConfig, pools: Mapping[str, BackendPool]) -> Membership:
    """The membership, item directory and feeds `config` asks for (`start` it in the loop)."""
    directory = ItemDirectory(max_items=config.directory_max_items)
    feeds = None
    server_keys: dict[str, bytes | None] = {}
    if config.events_port is not None:
        assert config.events_key_file is not None and config.events_encoder_key is not None
        keys = load_keypair(config.events_key_file)
        encoder_key = load_public_key(config.events_encoder_key)
        pd_key = load_public_key(config.events_pd_key) if config.events_pd_key else encoder_key
        server_keys = {ENCODER: encoder_key, PREFILL_DECODE: pd_key}
        feeds = DirectoryFeeds(directory, keys=keys, timeout_s=config.events_timeout_s)
    return Membership(
        pools,
        health_timeout_s=config.health_timeout_s,
        directory=directory,
        feeds=feeds,
        events_port=config.events_port,
        server_keys=server_keys,
    )


def discovery_from_config(config: ProxyConfig) -> dict[str, tuple[str, int]]:
    """Each role's (NAME, PORT) to discover."""
    out = {}
    if config.discover_encoders is not None:
        out[ENCODER] = split_target("--discover-encoders", config.discover_encoders)
    if config.discover_pd is not None:
        out[PREFILL_DECODE] = split_target("--discover-pd", config.discover_pd)
    if config.discover_decode is not None:
        out[DECODE] = split_target("--discover-decode", config.discover_decode)
    return out
