"""Reuse-aware routing: skip the encoders for items held, send a request where its items
are, and encode each new content once.

With `--routing reuse` (the default), for a chat request's distinct media parts:

1. **Held items skip the encoders.** A part whose content key (`identity`) names an item
   an encoder reported, and that the item directory says some instance holds now
   (`Directory.holders` non-empty), is not sent to an encoder: prefill/decode gets the
   item's params and placeholder metadata from the proxy's memory (`media` sends the part
   as its metadata only). Where every part is such, the encoders see nothing
   (`route_total{reason="held"}`). The directory is a hint: if the instance then fails
   the request (its fetch failed: the item was evicted, its holder is gone), `forward`
   sends it once more with its media and the instance encodes the item itself; the key
   is forgotten (`content_keys_total{outcome="stale"}`). A stale hint costs an encode,
   never a wrong embedding, as the item's mm_hash is the instances' own and the content
   key binds it to the bytes it was computed from.
2. **Prefill/decode by score.** Each healthy prefill/decode instance scores

       score = held - load_weight * in_flight

   where `held` is how many of the request's known items its region holds
   (`Directory.held_count`) and `in_flight` its requests from this proxy now;
   `--route-load-weight` (1 by default: one item already in place is worth one request
   in flight there). The highest score wins, ties to the least loaded; where no instance
   holds any of the items, it is the pool's least-loaded pick. So a chat's later turns,
   whose earlier images were pushed or fetched into one instance, land on that instance
   unless it is busier by more requests than they have items there.
3. **One encode per new content.** Concurrent requests of this proxy process that carry
   the same new content share one encode (`SingleFlight`, keyed by content key): the
   first sends it, the others wait for its params; the workers of one `--workers N`
   proxy share their flights through their supervisor (`link.SharedFlights`). Across
   separate proxies, each new part goes to the encoder that rendezvous hashing picks
   for its content key among the configured encoders (`rendezvous`), the same one for
   every proxy, whose own vLLM encoder cache answers the second request; while that
   encoder is out of rotation, the least-loaded one takes it.

`--routing load` routes as vLLM's example EPD proxy does, for comparison: every media part
to an encoder by load, prefill/decode by load.

Every request with media is counted by how it was routed (`route_total{reason}`: held,
mixed, new, load), and items that no encoder call was made for
(`encoder_calls_saved_total`: held, or sharing another request's encode), and the proxy
logs each request's route at debug level. With `--route-headers` (off by default), each
answer also says why it went where it went in an `x-ecshare-route` header
(`pd=URL;reason=REASON;items_held=K/N`), and where the proxy's time went before
prefill/decode answered, in a `Server-Timing` header (W3C; milliseconds): `parse` (the
body read and checked), `key` (content keys), `lookup` (known items, the directory, the
choice of prefill/decode), `encode` (the encoder calls), `wait` (another request's
encode), `render` (the media-free request), `pd` (from sending to prefill/decode to its
answer's headers); with `--prefill/--decode` (`handoff`), `prefill` (to the prefill
instance's whole one-token answer) and `decode` (from sending to decode to its answer's
headers) in place of `pd`. A step that did not happen is left out. The headers are off by
default because they name an internal instance and tell a caller whether its media was
held already (`reason=held`, `items_held`, no `encode` step): media another tenant may
have sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ecshare.apps.proxy.backends import Backend, BackendPool
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.fanout import Encoded, EncoderStage, MediaScan
from ecshare.apps.proxy.identity import KnownItems, content_key, is_remote
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.tenants import DEFAULT_TENANT
from ecshare.protocol import TransferParam

log = logging.getLogger(__name__)

ROUTE_HEADER = "x-ecshare-route"
TIMING_HEADER = "Server-Timing"


class Directory(Protocol):
    """Where items are now: the item directory's face that routing uses. The real one is
    fed by the instances' exact stored/pushed/evicted events (`directory`)."""

    def holders(self, mm_hash: str) -> frozenset[str]:
        """The backend URLs that hold `mm_hash` now (encoders and prefill/decode)."""
        ...

    def held_count(self, backend: str, mm_hashes: Collection[str]) -> int:
        """How many of `mm_hashes` the backend at URL `backend` holds now."""
        ...

    def is_encoder(self, backend: str) -> bool: ...

    def forget(self, backend: str) -> None: ...


class NoDirectory:
    """A directory that knows of nothing held: every item is encoded (where the proxy has
    no directory, the routing still shares encodes and places new content by its key)."""

    def holders(self, mm_hash: str) -> frozenset[str]:
        return frozenset()

    def held_count(self, backend: str, mm_hashes: Collection[str]) -> int:
        return 0

    def is_encoder(self, backend: str) -> bool:
        return False

    def forget(self, backend: str) -> None:
        return None


def rendezvous(key: str, backends: Sequence[Backend]) -> Backend | None:
    """The backend that `key` hashes highest with among all `backends` (healthy or not),
    as every proxy computes it alike; None where it is out of rotation (or there is none)."""
    best: Backend | None = None
    best_weight = b""
    for backend in backends:
        weight = hashlib.blake2b(f"{key}\x00{backend.url}".encode(), digest_size=8).digest()
        if best is None or weight > best_weight:
            best, best_weight = backend, weight
    return best if best is not None and best.healthy else None


def score(held: int, in_flight: int, load_weight: float) -> float:
    """A prefill/decode instance's score for a request (see the module docstring)."""
    return held - load_weight * in_flight


def choose_prefill_decode(
    pool: BackendPool, directory: Directory, mm_hashes: Collection[str], load_weight: float
) -> tuple[Backend | None, int]:
    """The instance for a request whose known items are `mm_hashes`, and how many of them
    it holds (see the module docstring)."""
    best: Backend | None = None
    best_key = (0.0, 0)
    best_held = 0
    if mm_hashes:
        for backend in pool.healthy():
            held = directory.held_count(backend.url, mm_hashes)
            key = (score(held, backend.in_flight, load_weight), -backend.in_flight)
            if held and (best is None or key > best_key):
                best, best_key, best_held = backend, key, held
    if best is not None:
        # Held items only win where they outweigh the load: the least loaded scores too.
        idle = pool.pick()
        if idle is not None and (score(0, idle.in_flight, load_weight), -idle.in_flight) > best_key:
            return idle, directory.held_count(idle.url, mm_hashes)
        return best, best_held
    return pool.pick(), 0


class SingleFlight:
    """In-process single flight: the first request with a key encodes, the others wait
    for what it found (None: it found nothing, and each waiter falls back as it would)."""

    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[object]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def join(self, key: str) -> asyncio.Future[object] | None:
        """The flight under way for `key` to wait on, or None: the caller now leads it
        and must `land` it, whatever happens."""
        flight = self._flights.get(key)
        if flight is not None:
            return flight
        self._flights[key] = asyncio.get_running_loop().create_future()
        return None

    def land(self, key: str, result: object) -> None:
        """End the flight the caller leads for `key`, handing `result` to its waiters."""
        flight = self._flights.pop(key, None)
        if flight is not None and not flight.done():
            flight.set_result(result)


@dataclass
class Route:
    """How one request was routed, as its answer's header and the debug log say it."""

    reason: str
    items: int  # distinct media items
    held: int = 0  # of them, in the chosen prefill/decode instance's region
    encoded: int = 0  # sent to an encoder by this request
    shared: int = 0  # taken from another request's encode
    steps: dict[str, float] = field(default_factory=dict)  # seconds per step, in order

    def header(self, pd_url: str) -> str:
        return f"pd={pd_url};reason={self.reason};items_held={self.held}/{self.items}"

    def timed(self, step: str, since: float) -> float:
        """Add the time from `since` to now to `step`; now (perf_counter)."""
        now = time.perf_counter()
        self.steps[step] = self.steps.get(step, 0.0) + now - since
        return now

    def server_timing(self) -> str:
        """The steps as a `Server-Timing` header value (see the module docstring)."""
        return ", ".join(f"{step};dur={s * 1e3:.3f}" for step, s in self.steps.items())


@dataclass
class Routed:
    """A request's routing: its items' params, where to send it, and why."""

    encoded: Encoded  # params and mm_hashes of every distinct media part
    chosen: Backend | None  # the prefill/decode instance to try first
    route: Route
    # (content key, mm_hash) of the items taken from memory: forgotten if the request,
    # sent without their media, fails at prefill/decode.
    reused: list[tuple[str, str]] = field(default_factory=list)


class Router:
    """Routes the requests of one proxy process (see the module docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        encoders: BackendPool,
        prefill_decode: BackendPool,
        metrics: ProxyMetrics,
        directory: Directory | None = None,
        push_names: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.directory: Directory = directory if directory is not None else NoDirectory()
        self._encoders = encoders
        self._prefill_decode = prefill_decode
        self._metrics = metrics
        self._push_names = dict(push_names or {})
        outcomes = {o: metrics.content_keys.labels(o) for o in ("hit", "miss", "expired")}
        outcomes |= {o: metrics.content_keys.labels(o) for o in ("evicted", "stale")}
        self.known = KnownItems(config.route_cache_items, lambda o: outcomes[o].inc())
        self.flights = SingleFlight()
        self._reasons = {r: metrics.route.labels(r) for r in ("held", "mixed", "new", "load")}

    def _push_to(self, chosen: Backend | None) -> tuple[str, ...]:
        name = self._push_names.get(chosen.url, "") if chosen is not None else ""
        return (name,) if name else ()

    async def route(
        self,
        stage: EncoderStage,
        body: Mapping[str, Any],
        scan: MediaScan,
        request_id: str,
        tenant: str = DEFAULT_TENANT,
    ) -> Routed:
        """Encode what must be, and choose prefill/decode, for the media parts of `scan`;
        the encoder calls take `tenant`'s slots (`slots`)."""
        if self.config.routing == "load":
            route = Route("load", len(scan.parts), encoded=len(scan.parts))
            began = time.perf_counter()
            # With push, the instance is chosen first: the encoders write the items into it.
            chosen = self._prefill_decode.pick() if self._push_names else None
            began = route.timed("lookup", began)
            encoded = await stage.encode(
                body, scan.parts, request_id, self._push_to(chosen), tenant=tenant
            )
            route.timed("encode", began)
            return self._counted(Routed(encoded, chosen, route), request_id)
        return self._counted(await self._reuse(stage, body, scan, request_id, tenant), request_id)

    async def _reuse(
        self,
        stage: EncoderStage,
        body: Mapping[str, Any],
        scan: MediaScan,
        request_id: str,
        tenant: str,
    ) -> Routed:
        parts = scan.parts
        route = Route("new", len(parts))
        now = time.monotonic()
        began = time.perf_counter()
        keys = [content_key(part, body, self.config.url_ttl_s) for part in parts]
        began = route.timed("key", began)
        encoded = Encoded({}, [None] * len(parts))
        reused: list[tuple[str, str]] = []
        waits: dict[int, asyncio.Future[object]] = {}
        new: list[int] = []
        led: set[str] = set()
        for i, key in enumerate(keys):
            if key is None or key in led:
                new.append(i)
                continue
            known = self.known.get(key, now)
            if known is not None and self.directory.holders(known.mm_hash):
                encoded.hashes[i] = known.mm_hash
                encoded.params[known.mm_hash] = known.param
                reused.append((key, known.mm_hash))
                continue
            flight = await self.flights.join(key)
            if flight is None:
                led.add(key)
                new.append(i)
            else:
                waits[i] = flight
        known_hashes = {h for h in encoded.hashes if h is not None}
        chosen, held = choose_prefill_decode(
            self._prefill_decode, self.directory, known_hashes, self.config.route_load_weight
        )
        began = route.timed("lookup", began)
        landed: dict[str, tuple[str, TransferParam] | None] = dict.fromkeys(led)
        try:
            if new:
                await self._encode_new(
                    stage, body, scan, new, keys, encoded, chosen, request_id, tenant
                )
                began = route.timed("encode", began)
                for i in new:
                    h = encoded.hashes[i]
                    key = keys[i]
                    if h is None or key is None:
                        continue
                    self._remember(key, parts[i], h, encoded.params[h], now)
                    if key in landed:
                        landed[key] = (h, _unpushed(encoded.params[h]))
        finally:
            for key, found in landed.items():
                self.flights.land(key, found)
        for i, flight in waits.items():
            # Shielded: this request going away must not cancel the flight others wait on.
            result = await asyncio.shield(flight)
            if isinstance(result, tuple):
                h, param = result
                encoded.hashes[i] = h
                encoded.params.setdefault(h, param)
                route.shared += 1
                # Learned too when another worker led the encode: this worker's next
                # request with the content is then a hit, not one more encode.
                key = keys[i]
                if key is not None:
                    self._remember(key, parts[i], h, param, now)
        if waits:
            route.timed("wait", began)
        if reused and len(reused) == len(parts):
            route.reason = "held"
        elif len(new) != len(parts):
            route.reason = "mixed"
        route.held, route.encoded = held, len(new)
        return Routed(encoded, chosen, route, reused)

    def _remember(
        self, key: str, part: Mapping[str, Any], mm_hash: str, param: TransferParam, now: float
    ) -> None:
        """Map a content key to its item: for good when inline, for `url_ttl_s` when fetched."""
        ttl = self.config.url_ttl_s if is_remote(part) else math.inf
        self.known.put(key, mm_hash, param, now + ttl)

    async def _encode_new(
        self,
        stage: EncoderStage,
        body: Mapping[str, Any],
        scan: MediaScan,
        new: list[int],
        keys: list[str | None],
        encoded: Encoded,
        chosen: Backend | None,
        request_id: str,
        tenant: str,
    ) -> None:
        """Encode the parts `new`, each on the encoder its content key names, into `encoded`."""
        backends = self._encoders.backends
        prefer = [
            rendezvous(k, backends) if k is not None else None for k in (keys[i] for i in new)
        ]
        parts = [scan.parts[i] for i in new]
        fresh = await stage.encode(body, parts, request_id, self._push_to(chosen), prefer, tenant)
        for j, i in enumerate(new):
            h = fresh.hashes[j]
            if h is not None:
                encoded.hashes[i] = h
                encoded.params.setdefault(h, fresh.params[h])
        for h, param in fresh.params.items():
            encoded.params.setdefault(h, param)

    def _counted(self, routed: Routed, request_id: str) -> Routed:
        route = routed.route
        self._reasons[route.reason].inc()
        saved = len(routed.reused) + route.shared
        if saved:
            self._metrics.encoder_calls_saved.inc(saved)
        log.debug(
            "%s: route %s, %d items: %d held at the chosen instance, %d encoded, %d shared",
            request_id,
            route.reason,
            route.items,
            route.held,
            route.encoded,
            route.shared,
        )
        return routed

    def forget(self, reused: list[tuple[str, str]]) -> None:
        """The items `reused` failed at prefill/decode: their content keys are stale."""
        for key, mm_hash in reused:
            self.known.stale(key, mm_hash)


def _unpushed(param: TransferParam) -> TransferParam:
    """`param` for another request: its push was for the request that encoded it."""
    return msgspec.structs.replace(param, pushed_to=()) if param.pushed_to else param
