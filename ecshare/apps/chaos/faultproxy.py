"""A TCP proxy that delays and cuts a control-plane connection.

CURVE encrypts every control message, so faults cannot be injected per
message. This proxy sits between a consumer and a producer's control port and
works on what it can see, the TCP byte stream: it holds forwarded chunks back
for a random time (order kept), it holds everything in one or both directions
for a while (a partition: connections stay open, nothing moves, then the
backlog flows), and it cuts connections (both sides reset, the chunk in hand
dropped), so messages in flight are lost and ZMQ reconnects and redoes its
CURVE handshake. It carries control only: NIXL's data plane connects producer
and consumer directly, so no fault here touches a read.

It runs an asyncio loop on its own thread; the knobs may be changed from any
thread while it runs.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ecshare.apps.chaos.hosts import enter_namespace


@dataclass
class Faults:
    delay_prob: float = 0.0  # chance that a chunk is held back
    max_delay_s: float = 0.0  # held back for uniform(0, max_delay_s)
    cut_prob: float = 0.0  # chance, per chunk, that the connection is cut instead


DIRECTIONS = ("to_producer", "to_consumer")


class FaultProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        faults: Faults,
        seed: int,
        listen_host: str = "127.0.0.1",
        netns: str = "",
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.faults = faults
        self.counters: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._burst_until = 0.0
        self._burst_max_delay_s = 0.0
        self._held_until = dict.fromkeys(DIRECTIONS, 0.0)
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-fault-proxy")
        self._thread.daemon = True
        self._thread.start()
        if netns:
            # The loop's thread, and every socket it opens, moves into the namespace.
            asyncio.run_coroutine_threadsafe(_enter(netns), self._loop).result(timeout=10)
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, listen_host, 0), self._loop
        ).result(timeout=10)
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        return f"tcp://{self.listen_host}:{self.port}"

    # -- knobs (any thread) ----------------------------------------------------------------

    def cut_all(self) -> None:
        """Reset every open connection now."""
        self._loop.call_soon_threadsafe(self._cut_all)

    def delay_burst(self, seconds: float, max_delay_s: float) -> None:
        """For `seconds`, hold back every chunk for uniform(0, max_delay_s)."""
        self._burst_max_delay_s = max_delay_s
        self._burst_until = time.monotonic() + seconds

    def hold(self, seconds: float, directions: tuple[str, ...] = DIRECTIONS) -> None:
        """For `seconds`, forward nothing in `directions`; then the backlog, in order."""
        unknown = set(directions) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"unknown direction {sorted(unknown)}: choose from {DIRECTIONS}")
        until = time.monotonic() + seconds
        for d in directions:
            self._held_until[d] = max(self._held_until[d], until)

    def calm(self) -> None:
        """No more faults: forward everything as it comes."""
        self.faults = Faults()
        self._burst_until = 0.0
        self._held_until = dict.fromkeys(DIRECTIONS, 0.0)

    def close(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            self._cut_all()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # -- the loop ----------------------------------------------------------------------------

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.counters["connections"] += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            self.counters["target_refused"] += 1  # the producer is down; the client retries
            client_w.transport.abort()
            return
        pair = (client_w, server_w)
        self._writers.update(pair)
        await asyncio.gather(
            self._pump(client_r, server_w, pair, "to_producer"),
            self._pump(server_r, client_w, pair, "to_consumer"),
        )

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        direction: str,
    ) -> None:
        try:
            while chunk := await reader.read(65536):
                faults = self.faults
                if self._rng.random() < faults.cut_prob:
                    self.counters["random_cuts"] += 1
                    break
                delay = 0.0
                if time.monotonic() < self._burst_until:
                    delay = self._rng.uniform(0, self._burst_max_delay_s)
                elif self._rng.random() < faults.delay_prob:
                    delay = self._rng.uniform(0, faults.max_delay_s)
                if delay:
                    self.counters["delayed_chunks"] += 1
                    await asyncio.sleep(delay)
                if (held := self._held_until[direction] - time.monotonic()) > 0:
                    self.counters["held_chunks"] += 1
                    while held > 0:  # the hold may be extended meanwhile
                        await asyncio.sleep(held)
                        held = self._held_until[direction] - time.monotonic()
                writer.write(chunk)
                await writer.drain()
                self.counters[f"bytes_{direction}"] += len(chunk)
        except (ConnectionError, OSError):
            pass
        for w in pair:  # one side ending ends the connection: no half-open ZMQ links
            w.transport.abort()
            self._writers.discard(w)


async def _enter(netns: str) -> None:
    enter_namespace(netns)  # runs on the loop's thread
