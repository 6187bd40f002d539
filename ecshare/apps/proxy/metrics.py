"""The proxy's Prometheus metrics, in a registry of its own (served at `/metrics`).

A registry per proxy, not the process-global one, so that several proxies in one process
(tests, the benchmark) never collide, and an embedding application's metrics stay its own.

Under `ecshare proxy --workers N` every worker process is started with
`PROMETHEUS_MULTIPROC_DIR` set (prometheus_client then keeps each value in a file of that
directory), and a worker's `/metrics` reads the files of all of them: the totals of the
whole proxy, whichever worker the scrape reaches. Gauges say how they combine: requests in
flight are summed over the live workers; a backend is up only while every live worker has
it in rotation; `worker_up` has one sample per live worker, labelled with its pid.

The item directory's, its feeds' and the membership's counters (`track_membership`) are
plain counts their owners keep; they are copied into the series at each scrape, and,
across workers, every second too (`sync_membership`), as a scrape reaches one worker
only. Each worker keeps its own directory and membership: the counters are summed over
workers, `directory_items` and `members` are the largest any live worker has.

A worker reads the directory while others write it, and one of them may just have
created a file and not yet sized it: `_SharedCollector` leaves such a file out (it holds
no sample yet), where prometheus_client's own collector fails on it (a worker whose
registry first read the directory then exited at its start).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# A values file's first 8 bytes say how much of it is used: one shorter holds nothing yet.
_HEADER_BYTES = 8

PREFIX = "ecshare_proxy_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Why a media item went to prefill/decode without ec_transfer_params (it is encoded there).
FALLBACK_REASONS = (
    "unreachable",
    "timeout",
    "error",
    "status",
    "answer",
    "params",
    "no_encoder",
)
# Why a request's prefill/decode stage failed; `resent`: a request sent on a kept-alive
# connection its instance was closing, sent once more (`forward`), not a failure itself.
UPSTREAM_REASONS = (
    "unreachable",
    "timeout",
    "error",
    "status",
    "no_backend",
    "broken_stream",
    "resent",
)
# Why a request (or a connection) was refused before any backend saw it.
REJECT_REASONS = (
    "auth",
    "body_too_large",
    "body_timeout",
    "bad_request",
    "bad_uuid",
    "client_uuid",
    "client_embeds",
    "client_mm_kwargs",
    "too_many_parts",
    "tenant_busy",
    "media_too_large",
    "encoder_busy",
    "pd_busy",
    # Connections (ecshare.apps.proxy.edge): refused, or closed before they earned a place.
    "connections",
    "address",
    "preauth",
    "evicted",
    "first_byte_timeout",
    "header_timeout",
)
# How a request with media was routed (ecshare.apps.proxy.routing).
ROUTE_REASONS = ("held", "mixed", "new", "load")
# What became of a content-key lookup (ecshare.apps.proxy.identity).
CONTENT_KEY_OUTCOMES = ("hit", "miss", "expired", "evicted", "stale")
# What became of client uuids the proxy let through (`--client-uuids strip` or `tenant`).
UUID_ACTIONS = ("stripped", "scoped")
# What prefill/decode got of a request's media: none of it, the media as sent, or the media
# after the media-free attempt failed.
PD_MEDIA_OUTCOMES = ("omitted", "kept", "retried")
# What became of a request split over a prefill and a decode instance (`handoff`).
HANDOFF_OUTCOMES = ("decoded", "prefill_retried", "decode_retried", "no_kv_params")
# The membership's `stats()` keys (ecshare.apps.proxy.discovery) and their series: the
# counter's name, and its label value where the counter is one of a family.
MEMBERSHIP_COUNTERS: dict[str, tuple[str, str | None]] = {
    "directory_applied": ("directory_messages", "applied"),
    "directory_duplicates": ("directory_messages", "duplicate"),
    "directory_stale_incarnation": ("directory_messages", "stale_incarnation"),
    "directory_unsynced": ("directory_messages", "unsynced"),
    "directory_unknown_backend": ("directory_messages", "unknown_backend"),
    "feeds_bad_messages": ("directory_messages", "bad"),
    "directory_snapshots": ("directory_snapshots", None),
    "directory_gaps": ("directory_forgotten", "gap"),
    "directory_restarts": ("directory_forgotten", "restart"),
    "directory_expired": ("directory_forgotten", "silent"),
    "directory_capped": ("directory_capped_items", None),
    "feeds_resync_requests": ("directory_resyncs", None),
    "joined": ("membership_changes", "joined"),
    "left": ("membership_changes", "left"),
    "refused": ("membership_changes", "refused"),
    "unauthorized": ("membership_changes", "unauthorized"),
    "dns_failures": ("discovery_failures", None),
}
_MEMBERSHIP_LABEL = {
    "directory_messages": "outcome",
    "directory_forgotten": "cause",
    "membership_changes": "change",
}
_MEMBERSHIP_HELP = {
    "directory_messages": "Item feed messages taken by the item directory, by outcome: "
    "applied, duplicate, stale_incarnation (an instance's older life), unsynced (waiting "
    "for a snapshot), unknown_backend, bad (did not decode).",
    "directory_snapshots": "Item snapshots applied by the item directory.",
    "directory_forgotten": "Times an instance's items were forgotten by the item directory, "
    "by cause: gap (events lost), restart (a new incarnation), silent (past "
    "--events-timeout).",
    "directory_capped_items": "Item entries dropped to stay under --directory-max-items.",
    "directory_resyncs": "Snapshots asked of instances' item feeds (resubscriptions).",
    "membership_changes": "Backends that joined or left at run time, registrations refused "
    "(bad body or too many members) and unauthorized (no admin key).",
    "discovery_failures": "DNS lookups of --discover-* names that failed (members unchanged).",
}


class _SharedCollector(MultiProcessCollector):
    """Every worker's values files, as prometheus_client reads them, less those not yet
    sized by the worker that is creating them, and those gone since the listing."""

    def collect(self) -> Iterable[Any]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(path) >= _HEADER_BYTES:
                    files.append(path)
            except FileNotFoundError:
                continue  # a dead worker's live gauges, removed (mark_process_dead)
        return self.merge(files, accumulate=True)


class ProxyMetrics:
    """Counters, histograms and gauges of one proxy."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        shared_dir = os.environ.get(MULTIPROC_DIR_ENV)
        self.multiprocess = bool(shared_dir)
        # Shared: the metrics write their files and the registry reads every worker's.
        r = None if self.multiprocess else self.registry
        if shared_dir:
            _SharedCollector(self.registry, path=shared_dir)
        self.requests = Counter(
            PREFIX + "requests",
            "Requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            PREFIX + "request_seconds",
            "Time from a request's arrival to its last byte, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            PREFIX + "ttft_seconds",
            "Time from a streamed request's arrival to the first bytes of its answer sent to "
            "the client (vLLM's first event comes with the first token), by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.encode_seconds = Histogram(
            PREFIX + "encode_seconds",
            "Time a request with media spent in the encoder stage.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.encoder_items = Counter(
            PREFIX + "encoder_items",
            "Media items sent to an encoder, by outcome (ok or fallback).",
            ["outcome"],
            registry=r,
        )
        self.encoder_fallbacks = Counter(
            PREFIX + "encoder_fallbacks",
            "Media items left to prefill/decode to encode locally, by reason.",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors",
            "Prefill/decode stages that failed, by reason.",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "rejected",
            "Requests refused before any backend saw them, and connections refused or "
            "closed before they earned a place (connections, address, preauth, evicted, "
            "first_byte_timeout, header_timeout), by reason.",
            ["reason"],
            registry=r,
        )
        self.client_uuids = Counter(
            PREFIX + "client_uuids",
            "Client uuids on media parts let through, by what the proxy made of them: "
            "stripped, or scoped to the client's tenant.",
            ["action"],
            registry=r,
        )
        self.client_params_dropped = Counter(
            PREFIX + "client_params_dropped",
            "Requests whose client-written ec_transfer_params or kv_transfer_params were "
            "dropped before prefill/decode (only the encoders' params choose where it "
            "fetches from, and only a prefill's which KV blocks decode reads).",
            registry=r,
        )
        self.pd_requests = Counter(
            PREFIX + "pd_requests",
            "Requests with media sent to prefill/decode, by what they carried: omitted (every "
            "item as its placeholder metadata only), kept (some or all media), retried (sent "
            "again with the media after the media-free attempt failed).",
            ["media"],
            registry=r,
        )
        self.handoffs = Counter(
            PREFIX + "handoffs",
            "Prefill-then-decode steps (--prefill/--decode), by outcome: decoded (a decode "
            "instance was sent the prefill's KV params), prefill_retried (a prefill instance "
            "failed, the request went to another with its media), decode_retried (a decode "
            "instance failed before its answer began: prefilled again, decoded elsewhere), "
            "no_kv_params (a prefill instance answered without KV params: 502).",
            ["outcome"],
            registry=r,
        )
        self.route = Counter(
            PREFIX + "route",
            "Requests with media by how they were routed: held (every item held somewhere, "
            "no encoder call), mixed (some held or shared, some encoded), new (every item "
            "encoded), load (--routing load).",
            ["reason"],
            registry=r,
        )
        self.encoder_calls_saved = Counter(
            PREFIX + "encoder_calls_saved",
            "Media items sent to no encoder: held by some instance, or sharing another "
            "request's encode in flight.",
            registry=r,
        )
        self.content_keys = Counter(
            PREFIX + "content_keys",
            "Content-key lookups and drops, by outcome: hit, miss, expired (--url-ttl), "
            "evicted (--route-cache-items), stale (prefill/decode failed the item).",
            ["outcome"],
            registry=r,
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects",
            "Requests whose client went away before the answer ended (upstream cancelled).",
            registry=r,
        )
        self.backend_up = Gauge(
            PREFIX + "backend_up",
            "1 while a backend is in rotation, 0 while it is ejected.",
            ["role", "url"],
            registry=r,
            multiprocess_mode="livemin",
        )
        # A plain int read at scrape time: cheaper per request than a locked gauge. Across
        # workers there is no scrape-time callback, so the shared gauge is kept instead.
        self.in_flight = 0
        self._shared_in_flight: Gauge | None = None
        in_flight = Gauge(
            PREFIX + "in_flight",
            "Requests being answered now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        if self.multiprocess:
            self._shared_in_flight = in_flight
            worker_up = Gauge(
                PREFIX + "worker_up",
                "1 for each live proxy worker process (label pid).",
                registry=r,
                multiprocess_mode="liveall",
            )
            worker_up.set(1)
        else:
            in_flight.set_function(lambda: self.in_flight)
        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}
        for reason in FALLBACK_REASONS:
            self.encoder_fallbacks.labels(reason)
        for reason in UPSTREAM_REASONS:
            self.upstream_errors.labels(reason)
        # Each reason's child, looked up once: a refused connection costs the proxy little
        # more than its accept, and `labels()` would be a third of that.
        self._rejected_by = {reason: self.rejected.labels(reason) for reason in REJECT_REASONS}
        for reason in ROUTE_REASONS:
            self.route.labels(reason)
        for outcome in CONTENT_KEY_OUTCOMES:
            self.content_keys.labels(outcome)
        for action in UUID_ACTIONS:
            self.client_uuids.labels(action)
        for outcome in ("ok", "fallback"):
            self.encoder_items.labels(outcome)
        # The children every request with media touches, looked up once.
        self.pd_media = {media: self.pd_requests.labels(media) for media in PD_MEDIA_OUTCOMES}
        self.handoff = {outcome: self.handoffs.labels(outcome) for outcome in HANDOFF_OUTCOMES}
        self.encoded_items = self.encoder_items.labels("ok")
        self._membership_series(r)

    def _membership_series(self, r: CollectorRegistry | None) -> None:
        families: dict[str, Counter] = {}
        for name, _ in MEMBERSHIP_COUNTERS.values():
            if name not in families:
                labels = _MEMBERSHIP_LABEL.get(name)
                families[name] = Counter(
                    PREFIX + name,
                    _MEMBERSHIP_HELP[name],
                    [labels] if labels else [],
                    registry=r,
                )
        self._membership_counters = {
            key: families[name].labels(label) if label is not None else families[name]
            for key, (name, label) in MEMBERSHIP_COUNTERS.items()
        }
        self.directory_items = Gauge(
            PREFIX + "directory_items",
            "(instance, item) entries the item directory holds now.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.members = Gauge(
            PREFIX + "members",
            "Backends in the proxy's pools now (in rotation or not), by role.",
            ["role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self._membership_seen: dict[str, int] = {}
        self._membership_source: Callable[[], tuple[Mapping[str, int], Mapping[str, int]]] | None
        self._membership_source = None

    def track_membership(
        self, source: Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]
    ) -> None:
        """Copy `source()`: (the membership's `stats()`, backends per role) into the series
        at each scrape and each `sync_membership`."""
        self._membership_source = source
        self.sync_membership()

    def sync_membership(self) -> None:
        """Bring the membership series up to what the tracked source counts now."""
        if self._membership_source is None:
            return
        stats, members = self._membership_source()
        for key, counter in self._membership_counters.items():
            now = stats.get(key, 0)
            grown = now - self._membership_seen.get(key, 0)
            if grown > 0:
                counter.inc(grown)
            self._membership_seen[key] = now
        self.directory_items.set(stats.get("directory_entries", 0))
        for role, count in members.items():
            self.members.labels(role).set(count)

    def started(self) -> None:
        """A request arrived; `answered` ends it."""
        self.in_flight += 1
        if self._shared_in_flight is not None:
            self._shared_in_flight.inc()

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        """Count one answered request; the labelled children are looked up once per pair."""
        self.in_flight -= 1
        if self._shared_in_flight is not None:
            self._shared_in_flight.dec()
        children = self._request_children.get((endpoint, status))
        if children is None:
            children = (
                self.requests.labels(endpoint, str(status)),
                self.request_seconds.labels(endpoint),
            )
            self._request_children[(endpoint, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def refused(self, reason: str) -> None:
        """Count a refusal of `reason` (`rejected_total`)."""
        child = self._rejected_by.get(reason)
        (child if child is not None else self.rejected.labels(reason)).inc()

    def fallback(self, reason: str, items: int = 1) -> None:
        self.encoder_items.labels("fallback").inc(items)
        self.encoder_fallbacks.labels(reason).inc(items)

    def exposition(self) -> bytes:
        self.sync_membership()
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), for tests and reports."""
        found = self.registry.get_sample_value(PREFIX + name, labels)
        return 0.0 if found is None else float(found)
