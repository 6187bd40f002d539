"""Prometheus metrics of producers, consumers and their stores, read at scrape time.

Every metric is defined once, in `SPECS`. Nothing is counted twice: the Producer,
Consumer, Store and control server keep their own counters, and `read_samples`
turns them into one snapshot (`Samples`) when someone asks. Two exporters use it:

- `ECShareCollector`, a prometheus_client collector on a registry of its own
  (never the global default: several peers can share a process), served on
  `config.metrics_port` by `expose` with prometheus_client's HTTP server;
- the vLLM connector, which ships snapshots to vLLM's frontend process and
  re-creates the same metrics there as `vllm:ecshare_*` (ecshare/vllm/metrics.py).

Names are `ecshare_<spec>` (counters end in `_total` in the exposition), units
are in the names, and labels are bounded: reasons, states, producer endpoints,
never an mm_hash.

Each counter a part keeps is listed once, in `COUNTED`: the metric it adds to, or
`events` (`ecshare_events_total{side, event}`: the diagnostic counters with no
metric of their own), or not exported, with the reason. A test holds the table to
every counter the parts' code counts, so that none is lost on the way.

This module sits above `peer/`: it reads the peers' own snapshots, and `peer/`
does not import it. It serves a started peer on `metrics_port` through the hook
`ecshare.peer.thread.add_exporter`, which it fills when it is imported (the
package root imports it).

Importing it also turns off prometheus_client's `<name>_created` series in the whole
process, for every ecshare exporter (this one, the proxy's, the connector's in vLLM)
and for whatever else the process exports: each counter, histogram and summary would
otherwise add a second series holding its creation time, nearly doubling the series
Prometheus stores, and nothing of ours reads them. prometheus_client has no switch per
registry, only this one per process.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeAlias, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ecshare.config import Config, ConfigError
from ecshare.peer.consumer import Consumer, LatencyHistogram
from ecshare.peer.producer import Producer
from ecshare.peer.thread import NetworkThread, add_exporter
from ecshare.peer.transfer import LATENCY_BUCKETS_S
from ecshare.store import Store

# What a collector holds: a store, a producer or a consumer.
Part: TypeAlias = Store | NetworkThread

log = logging.getLogger(__name__)
_P = TypeVar("_P")

disable_created_metrics()

PREFIX: Final = "ecshare_"
__all__ = [
    "COUNTED",
    "LATENCY_BUCKETS_S",
    "SPECS",
    "Counted",
    "ECShareCollector",
    "Exposure",
    "Kind",
    "SampleChanges",
    "Samples",
    "Side",
    "Spec",
    "expose",
    "read_samples",
]


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"


@dataclass(frozen=True)
class Spec:
    name: str  # without PREFIX, and without `_total` for a counter
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()


_C, _G = Kind.COUNTER, Kind.GAUGE
SPECS: Final[tuple[Spec, ...]] = (
    # consumer
    Spec("fetches_started", _C, "Fetches that went to the network (not local hits or joins)."),
    Spec("fetched_items", _C, "Items fetched from a producer into the local region."),
    Spec("fetched_bytes", _C, "Bytes fetched from producers over the data plane."),
    Spec("local_hits", _C, "Fetches answered from the local region without the network."),
    Spec(
        "fetch_failures",
        _C,
        "Fetches that failed for good (the item is encoded locally instead), by reason.",
        ("reason",),
    ),
    Spec(
        "fetch_retries",
        _C,
        "Retryable refusals (not ready, overloaded) a fetch waited out, by reason.",
        ("reason",),
    ),
    Spec("failovers", _C, "Times a fetch moved on to its next candidate producer."),
    Spec("checksum_failures", _C, "Items read whose checksum differed from the producer's."),
    Spec("bad_grants", _C, "Grants refused unread because their extents were invalid."),
    Spec("peer_failures", _C, "Producers put in quarantine, by reason.", ("reason",)),
    Spec("fetches_in_flight", _G, "Items being fetched now."),
    Spec("peer_up", _G, "1 while a session with the producer is established.", ("peer",)),
    Spec("peer_quarantined", _G, "1 while the producer is quarantined after a failure.", ("peer",)),
    Spec(
        "peer_last_heard_age_seconds",
        _G,
        "Seconds since the producer last answered (heartbeat or reply).",
        ("peer",),
    ),
    # producer
    Spec("grants", _C, "Items granted to consumers (each pins an entry until it ends)."),
    Spec("granted_bytes", _C, "Bytes of the items granted."),
    Spec("refusals", _C, "Requests and items refused, by reason.", ("reason",)),
    Spec("fetch_requests", _C, "Fetch requests received (a batch counts once)."),
    Spec("duplicate_requests", _C, "Fetch requests answered again from the reply cache."),
    Spec("released_grants", _C, "Grants released by their reader."),
    Spec("leases_expired", _C, "Grants ended because their lease ran out."),
    Spec("bad_notifications", _C, "Data-plane notices dropped as malformed or forged."),
    Spec("sessions_opened", _C, "Consumer sessions opened."),
    Spec("sessions_closed", _C, "Consumer sessions closed (bye, silence or shutdown)."),
    Spec("active_grants", _G, "Grants outstanding now."),
    Spec("sessions", _G, "Consumer sessions open now."),
    Spec(
        "control_messages_dropped",
        _C,
        "Control-plane messages dropped unread, by reason.",
        ("reason",),
    ),
    Spec("handshakes_accepted", _C, "CURVE handshakes admitted by the allow-list."),
    Spec(
        "lane_drops",
        _C,
        "Fetch-lane connections closed for a fault (no or wrong key, a forged, replayed, "
        "oversized or malformed frame, a bind too late), by reason.",
        ("reason",),
    ),
    Spec("auth_failures", _C, "Control-plane handshakes refused, by reason.", ("reason",)),
    # store
    Spec("region_size_bytes", _G, "Size of the region."),
    Spec("region_used_bytes", _G, "Bytes of the region in blocks held by entries."),
    Spec("region_payload_bytes", _G, "Bytes of entry data in the region (without block slack)."),
    Spec("region_entries", _G, "Entries in the region, by state.", ("state",)),
    Spec("region_pins", _G, "Pins held on entries now (grants being read, loads)."),
    Spec("region_pinned_entries", _G, "Entries with at least one pin."),
    Spec("region_evictions", _C, "Entries evicted to make room."),
    Spec("region_reaped_pins", _C, "Pins released because their lease ran out."),
    Spec(
        "region_quarantined_bytes",
        _G,
        "Bytes of blocks held because a read given up may still write them; "
        "freed when the transport says the read ended.",
    ),
    Spec(
        "region_canary_violations",
        _C,
        "Freed blocks found written when handed out again (store_canary only).",
    ),
    Spec(
        "region_foreign_writes",
        _C,
        "Entries found changed since their commit (a peer wrote the region) and dropped "
        "before use; needs a checksum.",
    ),
    Spec("fenced_reads", _G, "Reads given up whose end the transport has not yet confirmed."),
    Spec(
        "fenced_reads_by_kind",
        _G,
        "READs fenced (they may still write what they hold) whose end the transport has not "
        "yet confirmed, by kind: given_up (as fenced_reads), warm_up, tag_landing.",
        ("kind",),
    ),
    Spec(
        "fenced_read_oldest_age_seconds",
        _G,
        "Age of the oldest fenced read: growing, it means a peer that never ends its reads "
        "(their blocks are kept, not reused).",
    ),
    Spec(
        "healthy",
        _G,
        "1 while each producer and consumer network thread serves; 0 once one has died "
        "(its fetches then fail as internal; the log says why).",
    ),
    Spec("lease_renewals", _C, "Grants whose lease a slow read had renewed."),
    Spec("leases_run_out", _C, "Reads given up because the producer's lease was ending."),
    # push, consumer side
    Spec("pushed_items", _C, "Items a producer pushed into the local region (committed)."),
    Spec("pushed_in_bytes", _C, "Bytes of the items pushed into the local region."),
    Spec("push_refusals", _C, "Push offers this consumer refused, by reason.", ("reason",)),
    Spec(
        "push_fallbacks",
        _C,
        "Fetches that waited for a push and pulled instead (refused, failed or late).",
    ),
    Spec(
        "pushes_fenced",
        _C,
        "Push reservations given up while a write may still land, each held until it ends "
        "(those held now: pushes_fenced_in_flight).",
    ),
    Spec(
        "pushes_fenced_in_flight",
        _G,
        "Push reservations given up whose write has not yet ended, held now (every one "
        "counts once in pushes_fenced).",
    ),
    Spec(
        "push_credit_refusals",
        _C,
        "Writes into a standing credit whose claim this consumer refused, by reason.",
        ("reason",),
    ),
    # push, producer side
    Spec("pushes_written", _C, "Pushes whose write the data plane completed."),
    Spec("pushed_out_bytes", _C, "Bytes of the items pushed to consumers."),
    Spec("pushes_refused", _C, "Pushes that were not written, by reason.", ("reason",)),
    Spec("push_write_failures", _C, "Push writes the data plane ended in error."),
    Spec("pushes_in_flight", _G, "Pushes offered or being written now."),
    Spec("push_credit_writes", _C, "Pushes written into a standing credit, with no offer."),
    Spec(
        "push_credit_fallbacks",
        _C,
        "Pushes to a session with standing credit that were offered instead, by reason.",
        ("reason",),
    ),
    # the rest of the parts' counters (see COUNTED)
    Spec(
        "events",
        _C,
        "Diagnostic counters of producers, consumers and control servers that have no "
        "metric of their own (late replies, fenced reads ended, probes, ...), by side and name.",
        ("side", "event"),
    ),
)
SPEC_BY_NAME: Final = {spec.name: spec for spec in SPECS}
LATENCY_HISTOGRAM: Final = Spec(
    "fetch_latency_seconds",
    _G,  # unused: the histogram has its own family
    "Time from a fetch's start to its item being READY in the local region.",
)
EXPOSED_HISTOGRAM: Final = Spec(
    "exposed_latency_seconds",
    _G,  # unused: the histogram has its own family
    "Time from the engine asking for an item to it being local, per mode: pushed (a "
    "producer wrote it here) or pulled (read from a producer).",
    ("mode",),
)

# Samples: spec name -> label values -> value. Label values are () without labels.
Samples = dict[str, dict[tuple[str, ...], float]]


class Side(enum.Enum):
    """Whose counter: a Consumer's, a Producer's, or its control server's."""

    CONSUMER = "consumer"
    PRODUCER = "producer"
    CONTROL = "control"


@dataclass(frozen=True)
class Counted:
    """One counter a part keeps, and what it becomes here.

    `key` is the counter's name, or with `by_reason` the prefix before its reason
    (`failed.` of `failed.timeout`). `metric` is the spec it adds to; with `reason`
    it adds under that fixed label value. `EVENTS` puts it under
    `events{side, event}`; `NOT_EXPORTED` leaves it out, and `why` says why.
    """

    side: Side
    key: str
    metric: str
    by_reason: bool = False
    reason: str = ""
    why: str = ""


EVENTS: Final = "events"
NOT_EXPORTED: Final = ""
_CS, _PS, _CTL = Side.CONSUMER, Side.PRODUCER, Side.CONTROL
_DUPLICATE: Final = "the same count as a metric exported already"


def _events(side: Side, *keys: str) -> tuple[Counted, ...]:
    return tuple(Counted(side, key, EVENTS) for key in keys)


COUNTED: Final[tuple[Counted, ...]] = (
    # consumer: one metric each
    Counted(_CS, "fetches", "fetches_started"),
    Counted(_CS, "fetched", "fetched_items"),
    Counted(_CS, "fetched_bytes", "fetched_bytes"),
    Counted(_CS, "local_hits", "local_hits"),
    Counted(_CS, "failovers", "failovers"),
    Counted(_CS, "checksum_failures", "checksum_failures"),
    Counted(_CS, "bad_grants", "bad_grants"),
    Counted(_CS, "renewed", "lease_renewals"),
    Counted(_CS, "leases_run_out", "leases_run_out"),
    Counted(_CS, "push_committed", "pushed_items"),
    Counted(_CS, "push_committed_bytes", "pushed_in_bytes"),
    Counted(_CS, "push_fallbacks", "push_fallbacks"),
    Counted(_CS, "push_fenced", "pushes_fenced"),
    Counted(_CS, "failed.", "fetch_failures", by_reason=True),
    Counted(_CS, "retries.", "fetch_retries", by_reason=True),
    Counted(_CS, "peer_failures.", "peer_failures", by_reason=True),
    Counted(_CS, "push_refused.", "push_refusals", by_reason=True),
    Counted(_CS, "push_credit_refused.", "push_credit_refusals", by_reason=True),
    # The session's fetch lane: a lost one leaves the session on ZMQ (why, by reason).
    Counted(_CS, "lanes_lost.", EVENTS, by_reason=True),
    *_events(_CS, "lanes_opened", "lane_requests", "lane_resent", "requests_sent_by_caller"),
    *_events(_CS, "warm_ups", "warm_ups_skipped"),
    # Direct reads: read where the producer said (`Located`), then checked by digest or tag.
    *_events(
        _CS,
        "direct_reads",
        "direct_reads_stale",
        "direct_reads_failed",
        "tag_reads",
        "tag_reads_fenced",
        "tag_peeks",
        "tag_peeks_failed",
        "tag_landing_full",
        "locations_heard",
        "bad_locations",
        "locations_off_session",
        "read_here",
        "read_lent",
    ),
    *_events(
        _CS,
        "single_flight_joins",
        "fetched_by_push",
        "requests",
        "reads_started",
        "read_posts",
        "reads_fenced",
        "fenced_reads_ended",
        "late_replies",
        "handshakes_retried",
        "unexpected_notifications",
        "checksum_missing",
        "grants_expired_on_arrival",
        "lease_overruns",
        "renewals_sent",
        "renewals_refused",
        "releases_confirmed",
        "refused_peer_links",
        "peer_links_closed_idle",
        "peer_links_evicted",
        "push_offers",
        "push_offers_off_session",
        "push_duplicate_offers",
        "push_reserved",
        "push_notices",
        "push_unknown_notifications",
        "push_unknown_done",
        "push_done_after_end",
        "push_not_written",
        "push_deadlines",
        "push_waits_expired",
        "push_sessions_lost",
        "push_checksum_failures",
        "push_fences_ended_by_done",
        "push_fences_ended_by_notice",
        "push_fenced_ended",
        "push_probes",
        "push_probes_failed",
        "push_probes_inconclusive",
        "push_fences_leaked",
        "push_credits_granted",
        "push_credits_unavailable",
        "push_credits_returned",
        "push_credit_claims",
        "push_credit_committed",
        "releases_dropped_stale",
        "releases_dropped_with_session",
    ),
    # producer: one metric each
    Counted(_PS, "granted", "grants"),
    Counted(_PS, "granted_bytes", "granted_bytes"),
    Counted(_PS, "fetch_requests", "fetch_requests"),
    Counted(_PS, "duplicate_requests", "duplicate_requests"),
    Counted(_PS, "released", "released_grants"),
    Counted(_PS, "leases_expired", "leases_expired"),
    Counted(_PS, "bad_notifications", "bad_notifications"),
    Counted(_PS, "sessions_opened", "sessions_opened"),
    Counted(_PS, "sessions_closed", "sessions_closed"),
    Counted(_PS, "pushed", "pushes_written"),
    Counted(_PS, "pushed_bytes", "pushed_out_bytes"),
    Counted(_PS, "push_write_failures", "push_write_failures"),
    Counted(_PS, "refused_", "refusals", by_reason=True),
    Counted(_PS, "no_session", "refusals", reason="no_session"),
    Counted(_PS, "push_refused.", "pushes_refused", by_reason=True),
    Counted(_PS, "push_credit_writes", "push_credit_writes"),
    Counted(_PS, "push_credit_fallbacks.", "push_credit_fallbacks", by_reason=True),
    *_events(
        _PS,
        "internal_error",
        "unexpected_message",
        "releases_unmatched",
        "status_requests",
        "replayed_ended_grants",
        "releases_in_requests",
        # Renewals granted: lease_renewals counts them on the consumer's side, and
        # the two sides of one node must not add up to twice the renewals.
        "renewed",
        "grants_left_to_lease",
        "push_requests",
        "push_joined",
        "push_offers",
        "push_writes",
        "push_bad_extents",
        "push_late_replies",
        "push_duplicate_replies",
        "push_done_reported_late",
        "push_notices",
        "push_notices_unsent",
        "push_peer_refused",
        "push_credits",
        "push_credits_refused",
        "push_credits_repeated",
        "push_credit_voids",
        "lane_unavailable",
        "located",
        "located_sent",
    ),
    Counted(_PS, "push_failed", NOT_EXPORTED, why="push_write_failures counts the same ends"),
    Counted(_PS, "push_refused", NOT_EXPORTED, why="pushes_refused counts them by reason"),
    # the producer's control server
    Counted(_CTL, "dropped_", "control_messages_dropped", by_reason=True),
    Counted(_CTL, "auth_refused.", "auth_failures", by_reason=True),
    # libzmq fails these before the allow-list is asked (a client that has the
    # wrong server key fails here).
    Counted(_CTL, "handshake_failed_protocol", "auth_failures", reason="handshake_protocol"),
    Counted(_CTL, "handshake_failed_no_detail", "auth_failures", reason="handshake_other"),
    Counted(_CTL, "auth_accepted", "handshakes_accepted"),
    Counted(_CTL, "lane_dropped_", "lane_drops", by_reason=True),
    *_events(
        _CTL,
        "lane_accepted",
        "lane_bound",
        "lane_refused_unbound",
        "lane_closed",
        "lane_received",
        "lane_sent",
    ),
    *_events(
        _CTL,
        "received",
        "sent",
        "send_dropped_unreachable",
        "send_dropped_queue_full",
        "error_replies",
        "error_replies_suppressed",
        "disconnected",
    ),
    # A refusal by the allow-list also shows up as a failed-auth event: counted
    # once, by its reason, from the allow-list.
    Counted(_CTL, "handshake_failed_auth", NOT_EXPORTED, why="auth_failures counts it by reason"),
    Counted(_CTL, "auth_rejected", NOT_EXPORTED, why="auth_failures counts it by reason"),
    Counted(_CTL, "handshake_succeeded", NOT_EXPORTED, why=_DUPLICATE + " (handshakes_accepted)"),
)


@dataclass(frozen=True)
class _Table:
    exact: dict[str, Counted]
    by_reason: tuple[Counted, ...]

    def find(self, key: str) -> tuple[Counted, tuple[str, ...]] | None:
        """The row of a counter key, and the labels it adds under; None if unlisted."""
        row = self.exact.get(key)
        if row is not None:
            return row, (row.reason,) if row.reason else ()
        for row in self.by_reason:
            if key.startswith(row.key):
                return row, (key.removeprefix(row.key),)
        return None


def _table(side: Side) -> _Table:
    rows = [row for row in COUNTED if row.side is side]
    # Longest prefix first: `push_refused.` before a shorter prefix of it.
    prefixes = sorted((r for r in rows if r.by_reason), key=lambda r: -len(r.key))
    return _Table({r.key: r for r in rows if not r.by_reason}, tuple(prefixes))


_TABLES: Final = {side: _table(side) for side in Side}
_unlisted_logged: set[tuple[Side, str]] = set()


def _add_counters(out: Samples, side: Side, counters: dict[str, int]) -> None:
    """Every counter of one part, as its row in COUNTED says. A counter that is not
    listed (a new one) is exported under `events` and logged once."""
    table = _TABLES[side]
    for key, n in counters.items():
        found = table.find(key)
        if found is None:
            if (side, key) not in _unlisted_logged:
                _unlisted_logged.add((side, key))
                log.warning("ecshare metrics: %s counter %r is not in COUNTED", side.value, key)
            _add(out, EVENTS, n, (side.value, key))
            continue
        row, labels = found
        if row.metric == EVENTS:
            _add(out, EVENTS, n, (side.value, key))
        elif row.metric != NOT_EXPORTED:
            _add(out, row.metric, n, labels)


def _zeros(out: Samples, side: Side) -> None:
    """Counters with one metric each show from the start, at zero."""
    for row in COUNTED:
        if row.side is side and not row.by_reason and row.metric not in (EVENTS, NOT_EXPORTED):
            _add(out, row.metric, 0, (row.reason,) if row.reason else ())


def read_samples(
    stores: Iterable[Store] = (),
    producers: Iterable[Producer] = (),
    consumers: Iterable[Consumer] = (),
) -> Samples:
    """One snapshot of every spec in SPECS, summed over the parts given."""
    out: Samples = {spec.name: {} for spec in SPECS}
    for store in stores:
        _read_store(store, out)
    for producer in producers:
        _read_producer(producer, out)
    for consumer in consumers:
        _read_consumer(consumer, out)
    return out


def _add(out: Samples, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
    series = out[name]
    series[labels] = series.get(labels, 0) + value


def _worst(out: Samples, name: str, value: float) -> None:
    """A gauge that is as good as its worst part (healthy: 0 if any part is not)."""
    series = out[name]
    series[()] = min(series.get((), value), value)


def _read_store(store: Store, out: Samples) -> None:
    s = store.stats()
    _add(out, "region_size_bytes", s.total_blocks * s.block_size)
    _add(out, "region_used_bytes", s.used_blocks * s.block_size)
    _add(out, "region_payload_bytes", s.bytes_used)
    for state, n in (
        ("ready", s.ready),
        ("allocated", s.allocated),
        ("evicting", s.evicting),
        ("quarantined", s.quarantined),
    ):
        _add(out, "region_entries", n, (state,))
    _add(out, "region_quarantined_bytes", s.quarantined_blocks * s.block_size)
    _add(out, "region_canary_violations", s.canary_violations)
    _add(out, "region_foreign_writes", s.foreign_writes)
    _add(out, "region_pins", s.pins)
    _add(out, "region_pinned_entries", s.pinned_entries)
    _add(out, "region_evictions", s.evictions)
    _add(out, "region_reaped_pins", s.reaped_pins)


def _read_producer(producer: Producer, out: Samples) -> None:
    # The network thread writes the Counter under its own lock; copying a dict is
    # one step under the GIL, so the copy is consistent without taking that lock.
    _zeros(out, Side.PRODUCER)
    _add_counters(out, Side.PRODUCER, producer.counters.snapshot())
    _worst(out, "healthy", float(producer.healthy))
    _add(out, "active_grants", producer.active_grants())
    _add(out, "pushes_in_flight", producer.pushes_in_flight())
    _add(out, "sessions", producer.session_count())
    _zeros(out, Side.CONTROL)
    _add_counters(out, Side.CONTROL, producer.control_stats)


def _read_consumer(consumer: Consumer, out: Samples) -> None:
    _zeros(out, Side.CONSUMER)
    _add_counters(out, Side.CONSUMER, consumer.counter_snapshot())
    _worst(out, "healthy", float(consumer.healthy))
    _add(out, "fetches_in_flight", consumer.pending())
    fenced, oldest_s = consumer.fenced_reads()
    _add(out, "fenced_reads", fenced)
    _add(out, "fenced_read_oldest_age_seconds", oldest_s)
    for kind, n in consumer.fences().items():
        _add(out, "fenced_reads_by_kind", n, (kind,))
    _add(out, "pushes_fenced_in_flight", consumer.pushes_fenced_in_flight())
    for peer in consumer.peer_liveness():
        _add(out, "peer_up", float(peer.up), (peer.endpoint,))
        _add(out, "peer_quarantined", float(peer.quarantined), (peer.endpoint,))
        if peer.last_heard_age_s is not None:
            _add(out, "peer_last_heard_age_seconds", peer.last_heard_age_s, (peer.endpoint,))


def merged_latency(consumers: Iterable[Consumer]) -> LatencyHistogram | None:
    """The consumers' latency histograms added up; None without consumers."""
    total: LatencyHistogram | None = None
    for consumer in consumers:
        h = consumer.latency_histogram()
        if total is None:
            total = h
        else:
            counts = tuple(a + b for a, b in zip(total.counts, h.counts, strict=True))
            total = type(h)(h.bounds, counts, total.sum_s + h.sum_s)
    return total


def merged_exposed(consumers: Iterable[Consumer]) -> dict[str, LatencyHistogram]:
    """The consumers' exposed-latency histograms per mode, added up."""
    total: dict[str, LatencyHistogram] = {}
    for consumer in consumers:
        for mode, h in consumer.exposed_histograms().items():
            had = total.get(mode)
            if had is not None:
                counts = tuple(a + b for a, b in zip(had.counts, h.counts, strict=True))
                h = type(h)(h.bounds, counts, had.sum_s + h.sum_s)
            total[mode] = h
    return total


def latency_buckets(h: LatencyHistogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last, as Prometheus histograms carry them."""
    out = []
    running = 0
    for bound, n in zip((*h.bounds, float("inf")), h.counts, strict=True):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return out


# -- shipping samples to another process ---------------------------------------------------------

# A shipped sample's key: "<c|g>:<spec name>[|label value...]".
_KEY_SEP: Final = "|"


def sample_key(spec: Spec, labels: tuple[str, ...] = ()) -> str:
    kind = "c" if spec.kind is Kind.COUNTER else "g"
    return _KEY_SEP.join((f"{kind}:{spec.name}", *labels))


def parse_sample_key(key: str) -> tuple[Spec, tuple[str, ...]] | None:
    """The spec and label values of a shipped key; None for a key that is not one
    (another version's metric, or not a sample at all)."""
    kind, _, rest = key.partition(":")
    name, *labels = rest.split(_KEY_SEP)
    spec = SPEC_BY_NAME.get(name)
    if spec is None or kind != ("c" if spec.kind is Kind.COUNTER else "g"):
        return None
    if len(labels) != len(spec.labels):
        return None
    return spec, tuple(labels)


class SampleChanges:
    """What changed since the last call, for an exporter in another process.

    Counters become increments, gauges their new value; unchanged samples are
    left out, so that an idle instance ships nothing. `names` limits what is shipped.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._specs = [SPEC_BY_NAME[name] for name in names]
        self._last: dict[str, float] = {}

    def take(self, samples: Samples) -> dict[str, float]:
        out: dict[str, float] = {}
        for spec in self._specs:
            for labels, now in samples.get(spec.name, {}).items():
                key = sample_key(spec, labels)
                last = self._last.get(key)
                if now == last:
                    continue
                self._last[key] = now
                if spec.kind is Kind.GAUGE:
                    out[key] = now
                elif last is None or now > last:
                    # Shipped once at zero too, so that the far side shows the series.
                    # A counter that went back (a restarted part) ships no negative step.
                    out[key] = now - (last or 0.0)
        return out


def is_gauge_key(key: str) -> bool:
    return key.startswith("g:")


# -- the collector -------------------------------------------------------------------------------


@dataclass(eq=False)
class ECShareCollector(Collector):
    """Every ecshare metric of the parts it holds, read when the registry is scraped.

    Register it on a `CollectorRegistry` of your own; parts can be added and
    removed while it is registered (any thread).
    """

    stores: list[Store] = field(default_factory=list)
    producers: list[Producer] = field(default_factory=list)
    consumers: list[Consumer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, part: Part) -> None:
        """Hold `part`; a part added twice (a store two peers share) is read once."""
        with self._lock:
            self._list_of(part).append(part)

    def remove(self, part: Part) -> None:
        """Undo one `add` of `part`."""
        with self._lock:
            target = self._list_of(part)
            for i, held in enumerate(target):
                if held is part:
                    del target[i]
                    return

    def _list_of(self, part: object) -> list[object]:
        if isinstance(part, Producer):
            return self.producers  # type: ignore[return-value]
        if isinstance(part, Consumer):
            return self.consumers  # type: ignore[return-value]
        if isinstance(part, Store):
            return self.stores  # type: ignore[return-value]
        raise TypeError(f"no metrics for a {type(part).__name__}")

    def describe(self) -> Iterable[Metric]:
        # Names only, so that registering never reads the parts.
        return list(_families({spec.name: {} for spec in SPECS}, None, with_histogram=True))

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            stores, producers, consumers = (
                _distinct(self.stores),
                _distinct(self.producers),
                _distinct(self.consumers),
            )
        samples = read_samples(stores, producers, consumers)
        return list(
            _families(
                samples,
                merged_latency(consumers),
                with_histogram=bool(consumers),
                exposed=merged_exposed(consumers),
            )
        )


def _distinct(parts: list[_P]) -> list[_P]:
    return list({id(part): part for part in parts}.values())


def _families(
    samples: Samples,
    latency: LatencyHistogram | None,
    *,
    with_histogram: bool,
    exposed: dict[str, LatencyHistogram] | None = None,
) -> Iterator[Metric]:
    for spec in SPECS:
        family: CounterMetricFamily | GaugeMetricFamily
        if spec.kind is Kind.COUNTER:
            family = CounterMetricFamily(PREFIX + spec.name, spec.doc, labels=spec.labels)
        else:
            family = GaugeMetricFamily(PREFIX + spec.name, spec.doc, labels=spec.labels)
        for labels, value in sorted(samples.get(spec.name, {}).items()):
            family.add_metric(list(labels), value)
        yield family
    if with_histogram:
        hist = HistogramMetricFamily(PREFIX + LATENCY_HISTOGRAM.name, LATENCY_HISTOGRAM.doc)
        if latency is not None:
            hist.add_metric([], latency_buckets(latency), sum_value=latency.sum_s)
        yield hist
        exposed_hist = HistogramMetricFamily(
            PREFIX + EXPOSED_HISTOGRAM.name, EXPOSED_HISTOGRAM.doc, labels=EXPOSED_HISTOGRAM.labels
        )
        for mode, h in sorted((exposed or {}).items()):
            exposed_hist.add_metric([mode], latency_buckets(h), sum_value=h.sum_s)
        yield exposed_hist


# -- the HTTP endpoint ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Endpoint:
    host: str
    port: int
    registry: CollectorRegistry
    collector: ECShareCollector
    server: WSGIServer
    thread: threading.Thread
    users: int = 0


_endpoints: dict[tuple[str, int], _Endpoint] = {}
_endpoints_lock = threading.Lock()


class Exposure:
    """One peer's place on a metrics endpoint; `close()` takes it off (idempotent)."""

    def __init__(self, endpoint: _Endpoint, parts: Sequence[Part]) -> None:
        self._endpoint: _Endpoint | None = endpoint
        self._parts = tuple(parts)

    @property
    def url(self) -> str:
        assert self._endpoint is not None, "closed"
        host = self._endpoint.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self._endpoint.port}/metrics"

    @property
    def registry(self) -> CollectorRegistry:
        assert self._endpoint is not None, "closed"
        return self._endpoint.registry

    def close(self) -> None:
        with _endpoints_lock:
            endpoint, self._endpoint = self._endpoint, None
            if endpoint is None:
                return
            for part in self._parts:
                endpoint.collector.remove(part)
            endpoint.users -= 1
            if endpoint.users:
                return
            del _endpoints[(endpoint.host, endpoint.port)]
        endpoint.server.shutdown()
        endpoint.server.server_close()
        endpoint.thread.join(timeout=5.0)


def expose(config: Config, *parts: Part) -> Exposure | None:
    """Serve `parts` on http://listen_host:metrics_port/metrics; None when metrics_port is unset.

    Peers of one process that are configured with the same port (a producer and a
    consumer over one store) share one endpoint, which closes with the last of them.
    A port another process holds is a `ConfigError` naming it.
    """
    port = config.metrics_port
    if port is None:
        return None
    host = config.listen_host
    with _endpoints_lock:
        endpoint = _endpoints.get((host, port))
        if endpoint is None:
            registry = CollectorRegistry(auto_describe=True)
            collector = ECShareCollector()
            registry.register(collector)
            try:
                server, thread = start_http_server(port, addr=host, registry=registry)
            except OSError as exc:
                raise ConfigError(
                    "metrics_port",
                    f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                ) from None
            thread.name = f"ecshare-metrics-{port}"
            endpoint = _Endpoint(host, port, registry, collector, server, thread)
            _endpoints[(host, port)] = endpoint
            log.info("serving ecshare metrics on http://%s:%d/metrics", host, port)
        for part in parts:
            endpoint.collector.add(part)
        endpoint.users += 1
        return Exposure(endpoint, parts)


def _export(peer: NetworkThread) -> Exposure | None:
    """The exporter every started peer is handed: its store and itself on metrics_port."""
    return expose(peer.config, peer.store, peer)


add_exporter(_export)
