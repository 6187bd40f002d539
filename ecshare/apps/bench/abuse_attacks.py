"""The attackers of ``ecshare bench abuse``: real clients, each attack from its own addresses.

Run as a child process (`python -m ecshare.apps.bench.abuse_attacks PLAN`), so that the
victim's timings in the parent never wait on an attacker's turn of the event loop: it
reads one `AttackPlan` (JSON) from the file PLAN, starts every attack, prints `ATTACKING`
once all are under way, and on SIGTERM stops them and prints their `AttackTally`s (one
JSON list) on stdout. It runs at the lowest priority (`ATTACKER_NICENESS`, 19), its
session too: on a small host the attackers stand for clients on other machines, whose
CPU is not the instances', so they take only what the launch leaves idle.

Every socket binds its source address before it connects (all of 127/8 is loopback on
Linux), so the proxy sees each attack come from addresses of its own
(`attack_addresses`), never from 127.0.0.1, the victim's: a per-address cap weighs on
attackers only. An attacker tries again `retry_delay_s` after the proxy refuses or closes
it, as a real one would.

Raw attacks, bytes written by hand on a socket:

* ``idle``: connects and sends nothing.
* ``half_headers``: a request line and one header, then a header line every
  `trickle_s`, never the blank line that ends them.
* ``slow_bodies`` (no key) and ``slow_bodies_keyed`` (the flood tenant's): a whole
  header announcing `SLOW_BODY_BYTES` of body, then one byte every `trickle_s`.

HTTP attacks (aiohttp, a session per address), all as the flood tenant:

* ``bombs``: requests of one PNG of `BOMB_SIDE` x `BOMB_SIDE` grey pixels, about 64 kB
  compressed; each differs in its last row, so that no cache keyed by content (the
  proxy's, an instance's) spares the next one its decode.
* ``many_parts``: requests of `parts` small images each, more than the limit.
* ``flood``: `flood` streamed requests at once, each with a fresh image.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import random
import signal
import struct
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ecshare.apps.bench.abuse_report import BOMB_SIDE, AbuseSpec, AttackTally
from ecshare.vllm.servers import chat_request, random_image_url

__all__ = [
    "ATTACKING",
    "AttackPlan",
    "attack_addresses",
    "bomb_png",
    "main",
    "run_attacks",
]

ATTACKING = "ATTACKING"
ATTACKER_NICENESS = 19
SLOW_BODY_BYTES = 100_000
CONNECT_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 300.0
CHAT_PATH = "/v1/chat/completions"


class AttackPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the child is told: the run's settings, and where and as whom to attack."""

    spec: AbuseSpec
    url: str  # the proxy's base URL
    flood_key: str  # the flood tenant's API key


def attack_addresses(first: str, index: int, count: int) -> tuple[str, ...]:
    """The `count` source addresses of attack number `index`, after `first`."""
    start = int(IPv4Address(first)) + index * count
    return tuple(str(IPv4Address(start + n)) for n in range(count))


def bomb_png(side: int = BOMB_SIDE) -> Callable[[], bytes]:
    """A maker of PNGs of `side` x `side` 8-bit grey pixels, all black but a random last
    row: the compressed rows above it are made once, and each PNG only adds its last."""
    rows = zlib.compressobj(9)
    above = rows.compress((b"\x00" * (side + 1)) * (side - 1))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    )

    def make() -> bytes:
        last = rows.copy()
        data = above + last.compress(b"\x00" + random.randbytes(side)) + last.flush()
        return header + chunk(b"IDAT", data) + chunk(b"IEND", b"")

    return make


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _fresh_image(side: int | None = None) -> str:
    seed = random.getrandbits(62)
    return random_image_url(seed) if side is None else random_image_url(seed, side, side)


class _Raw:
    """One raw attack: `clients` connections, each sending `opener` and then `trickle`
    every `every_s` (None: nothing more) until the proxy answers or closes it."""

    def __init__(
        self,
        plan: AttackPlan,
        tally: AttackTally,
        opener: bytes,
        trickle: bytes | None,
        stop: asyncio.Event,
    ) -> None:
        self.stop = stop
        parts = urlsplit(plan.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.tally, self.opener, self.trickle = tally, opener, trickle
        self.every_s, self.delay_s = plan.spec.trickle_s, plan.spec.retry_delay_s

    async def client(self, address: str) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port, local_addr=(address, 0)),
                    CONNECT_TIMEOUT_S,
                )
            except asyncio.TimeoutError:
                self.tally.tries += 1
                self.tally.ended("connect timeout", time.monotonic() - started)
                await asyncio.sleep(self.delay_s)
                continue
            except OSError as exc:
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                self.tally.tries += 1
                self.tally.ended(f"connect {name}", 0.0)
                await asyncio.sleep(self.delay_s)
                continue
            self.tally.opened()
            started = time.monotonic()
            try:
                outcome = await self._hold(reader, writer)
            finally:
                self.tally.open_now -= 1
                writer.close()
            self.tally.ended(outcome, time.monotonic() - started)
            await asyncio.sleep(self.delay_s)

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """The proxy's answer ("HTTP 503"), "closed" or "reset"."""
        head = b""
        try:
            if self.opener:
                writer.write(self.opener)
                await writer.drain()
            while b"\r\n\r\n" not in head and len(head) < 16384:
                try:
                    data = await asyncio.wait_for(
                        reader.read(4096), self.every_s if self.trickle else None
                    )
                except asyncio.TimeoutError:
                    assert self.trickle is not None
                    writer.write(self.trickle)
                    await writer.drain()
                    continue
                if not data:
                    break
                head += data
        except ConnectionError:
            return "reset" if not head else _status(head, self.tally)
        return "closed" if not head else _status(head, self.tally)


def _status(head: bytes, tally: AttackTally) -> str:
    if b"\r\nretry-after:" in head.lower():
        tally.retry_after += 1
    line = head.split(b"\r\n", 1)[0].split()
    if len(line) >= 2 and line[0].startswith(b"HTTP/"):
        return f"HTTP {line[1].decode(errors='replace')}"
    return "not HTTP"


def _raw_attacks(
    plan: AttackPlan, tallies: dict[str, AttackTally], stop: asyncio.Event
) -> list[Awaitable[None]]:
    host = urlsplit(plan.url).netloc
    request_line = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\n".encode()
    slow = (
        request_line
        + (f"Content-Type: application/json\r\nContent-Length: {SLOW_BODY_BYTES}\r\n").encode()
    )
    keyed = slow + f"Authorization: Bearer {plan.flood_key}\r\n".encode()
    kinds = {
        "idle": (b"", None),
        "half_headers": (request_line, b"X-Pad: 1\r\n"),
        "slow_bodies": (slow + b"\r\n", b" "),
        "slow_bodies_keyed": (keyed + b"\r\n", b" "),
    }
    out: list[Awaitable[None]] = []
    for name, (opener, trickle) in kinds.items():
        tally = tallies[name]
        raw = _Raw(plan, tally, opener, trickle, stop)
        out += [raw.client(tally.addresses[n % len(tally.addresses)]) for n in range(tally.clients)]
    return out


class _Http:
    """One HTTP attack: `clients` loops, each sending `body()` as the flood tenant."""

    def __init__(
        self,
        plan: AttackPlan,
        tally: AttackTally,
        body: Callable[[], dict[str, Any]],
        stop: asyncio.Event,
    ) -> None:
        self.stop = stop
        self.url, self.tally, self.body = plan.url + CHAT_PATH, tally, body
        self.headers = {"Authorization": f"Bearer {plan.flood_key}"}
        self.delay_s = plan.spec.retry_delay_s

    async def client(self, session: Any) -> None:
        import aiohttp

        while not self.stop.is_set():
            body = self.body()
            self.tally.opened()
            started = time.monotonic()
            try:
                async with session.post(self.url, json=body, headers=self.headers) as resp:
                    if "Retry-After" in resp.headers:
                        self.tally.retry_after += 1
                    async for _ in resp.content.iter_any():
                        pass
                    outcome = f"HTTP {resp.status}"
            except asyncio.TimeoutError:
                outcome = "timeout"
            except aiohttp.ClientError as exc:
                outcome = type(exc).__name__
                if isinstance(exc, OSError) and exc.errno:
                    outcome += " " + errno.errorcode.get(exc.errno, str(exc.errno))
            finally:
                self.tally.open_now -= 1
            self.tally.ended(outcome, time.monotonic() - started)
            if outcome != "HTTP 200":
                await asyncio.sleep(self.delay_s)


def _http_bodies(plan: AttackPlan) -> dict[str, Callable[[], dict[str, Any]]]:
    spec = plan.spec
    bomb = bomb_png()

    def streamed(urls: list[str], max_tokens: int) -> dict[str, Any]:
        return {**chat_request(urls, max_tokens=max_tokens), "stream": True}

    return {
        "bombs": lambda: chat_request([_data_url(bomb())], max_tokens=1),
        "many_parts": lambda: chat_request(
            [_fresh_image(56) for _ in range(spec.parts)], max_tokens=1
        ),
        "flood": lambda: streamed([_fresh_image()], spec.max_tokens),
    }


async def run_attacks(
    plan: AttackPlan, stop: asyncio.Event, started: Callable[[], None]
) -> list[AttackTally]:
    """Every attack of `plan` until `stop` is set; what each met."""
    import aiohttp

    tallies = {
        name: AttackTally(
            attack=name,
            addresses=attack_addresses(plan.spec.first_address, n, plan.spec.addresses_per_attack),
            clients=clients,
        )
        for n, (name, clients) in enumerate(plan.spec.attacks().items())
    }
    bodies = _http_bodies(plan)
    sessions = []
    jobs = _raw_attacks(plan, tallies, stop)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    for name, body in bodies.items():
        tally = tallies[name]
        http = _Http(plan, tally, body, stop)
        mine = [
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=(address, 0), limit=0),
                timeout=timeout,
            )
            for address in tally.addresses
        ]
        sessions += mine
        jobs += [http.client(mine[n % len(mine)]) for n in range(tally.clients)]
    tasks = [asyncio.ensure_future(job) for job in jobs]
    started()
    try:
        await stop.wait()
    finally:
        for tally in tallies.values():
            tally.open_at_end = tally.open_now
        # A cancel can be lost where a wait_for's inner call ends as it lands: each loop
        # also checks `stop`, and what is still running is cancelled again.
        stop.set()
        pending = set(tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        for session in sessions:
            await session.close()
    return list(tallies.values())


def main(argv: list[str] | None = None) -> int:
    (path,) = sys.argv[1:] if argv is None else argv
    with open(path, "rb") as f:
        plan = msgspec.json.decode(f.read(), type=AttackPlan)
    os.nice(ATTACKER_NICENESS)

    async def run() -> list[AttackTally]:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await run_attacks(plan, stop, lambda: print(ATTACKING, flush=True))

    tallies = asyncio.run(run())
    sys.stdout.write(msgspec.json.encode(tallies).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
