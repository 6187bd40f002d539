"""The connector's stats as Prometheus metrics on vLLM's own `/metrics` endpoint.

vLLM passes each step's `ECShareStats` data to `observe()` in its frontend
process. The names start with `vllm:` so that vLLM's registry clean-up
(`unregister_vllm_metrics`) treats them as its own.

Two kinds of data arrive: the connector's own counters (`COUNTERS`) and
latency samples (`HISTOGRAMS`: fetch latency, and exposed latency by mode),
and the core metrics of its Producer, Consumer and store (`CORE_METRICS`,
defined once in `ecshare.metrics`), which the scheduler side reads in the
engine process and ships as changes (`SampleChanges`). Both appear as
`vllm:ecshare_<name>`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics

from ecshare.metrics import LATENCY_BUCKETS_S, SPEC_BY_NAME, Kind, parse_sample_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:ecshare_"

COUNTERS = {
    "fetches_started": "Fetches started for items named in a request's ec_transfer_params.",
    "fetched_items": "Items fetched from a producer into this instance's region.",
    "fetched_bytes": "Bytes fetched from producers over the data plane (NIXL).",
    "fetched_direct_items": "Items of fetched_items read with one READ and no request: their "
    "producer had said where they lie (direct reads).",
    "fetch_failed": "Fetches that failed for good (the item is then encoded locally).",
    "local_encode_fallbacks": "Items encoded locally because their fetch failed.",
    "media_free_items": "Items that arrived as placeholder metadata only, without their media "
    "(media-free prefill/decode): their fetch must succeed, as there is nothing to encode.",
    "requests_unavailable": "Requests failed because an item could be neither fetched nor encoded.",
    "params_unusable": "Items whose ec_transfer_params were malformed or incompatible.",
    "loaded_items": "Items copied from the region into the engine's encoder cache.",
    "load_failed": "Items whose copy into the encoder cache failed.",
    "saved_items": "Encoder outputs stored in the region and offered to consumers.",
    "saved_bytes": "Bytes of encoder output stored in the region.",
    "save_failed": "Encoder outputs the workers failed to store.",
    "save_skipped": "Encoder outputs not stored (region full, or too large).",
    "save_abandoned": "Saves given up because no worker report came within save_report_timeout_s.",
    "saves_from_cache": "Items stored again from the engine's own encoder cache "
    "(it did not encode them again, and the region had lost them).",
    "stale_reports": "Worker reports naming a save no longer in flight (ignored).",
    "local_encodes": "Items a consuming instance encoded itself (not found in its region).",
    "peer_refused": "Fetches refused because the params named a producer not in trusted_producers.",
    "size_mismatch": "Items whose params or fetched entry did not match the shape and dtype "
    "the model expects (not used; the item is encoded locally).",
    "fetch_region_full": "Fetches refused by the region's admission: no room without "
    "evicting what waiting requests hold.",
    "fetches_abandoned": "Fetches whose every waiting request ended (aborted) before they did.",
    "fetches_overdue": "Fetches the consumer never settled (its network thread may have died).",
    "pins_reaped": "Pins reaped after their lease ran out (a lost release).",
    "push_announced": "Items whose ec_transfer_params said their encoder pushes them here.",
    "push_received": "Items a request got by push: its encoder wrote them here, before or "
    "while the scheduler waited (the rest of the announced ones were pulled).",
    "push_received_bytes": "Bytes of the items requests got by push.",
    "push_params_unusable": "Requests or items whose push params (push_to, pushed_to) were "
    "malformed (nothing pushed; the item is pulled).",
    "pushes_started": "Pushes an encoder started for the items of finished requests.",
    "push_names_refused": "Push names a request asked for that this encoder does not push to: "
    "not in push_targets, or no consumer of that name holds a push session with it.",
}
_EXPOSED_DOC = (
    "Time from the scheduler asking for an item to it being local, per mode: pushed (its "
    "encoder wrote it here) or pulled (read from the encoder)."
)
# Stats key -> (metric name, documentation, the `mode` label's value or None).
HISTOGRAMS = {
    "fetch_latency_s": (
        "fetch_latency_seconds",
        "Time from a fetch's start to its item being READY in the local region.",
        None,
    ),
    "exposed_pushed_s": ("exposed_latency_seconds", _EXPOSED_DOC, "pushed"),
    "exposed_pulled_s": ("exposed_latency_seconds", _EXPOSED_DOC, "pulled"),
}
# Core metrics shown on vLLM's endpoint too; those the connector counts itself
# (fetched items and bytes, the latency histogram) are in COUNTERS and HISTOGRAMS.
CORE_METRICS = (
    "healthy",
    "refusals",
    "grants",
    "granted_bytes",
    "active_grants",
    "sessions",
    "auth_failures",
    "checksum_failures",
    "peer_failures",
    "peer_up",
    "peer_quarantined",
    "region_size_bytes",
    "region_used_bytes",
    "region_payload_bytes",
    "region_entries",
    "region_pins",
    "region_evictions",
    # push: the consumer side
    "pushed_items",
    "pushed_in_bytes",
    "push_refusals",
    "push_fallbacks",
    "pushes_fenced",
    "pushes_fenced_in_flight",
    # push: the producer side
    "pushes_written",
    "pushed_out_bytes",
    "pushes_refused",
    "push_write_failures",
    "pushes_in_flight",
)


class ECSharePromMetrics(ECConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in COUNTERS.items():
            counter = self._counter_cls(name=PREFIX + key, documentation=doc, labelnames=labelnames)
            self._counters[key] = self._per_engine(counter)
        self._histograms: dict[str, dict[int, Any]] = {}
        families: dict[str, Any] = {}
        for key, (name, doc, mode) in HISTOGRAMS.items():
            family = families.get(name)
            if family is None:
                histogram_cls: Any = self._histogram_cls
                family = families[name] = histogram_cls(
                    name=PREFIX + name,
                    documentation=doc,
                    labelnames=[*labelnames, "mode"] if mode is not None else labelnames,
                    buckets=list(LATENCY_BUCKETS_S),
                )
            self._histograms[key] = {
                idx: family.labels(*values, *([mode] if mode is not None else []))
                for idx, values in self.per_engine_labelvalues.items()
            }
        # Labelled per sample (reason, peer, state), so kept whole, not per engine.
        self._core: dict[str, Any] = {}
        for name in CORE_METRICS:
            spec = SPEC_BY_NAME[name]
            labels = [*labelnames, *spec.labels]
            if spec.kind is Kind.COUNTER:
                metric = self._counter_cls(
                    name=PREFIX + name, documentation=spec.doc, labelnames=labels
                )
            else:
                gauge_cls: Any = self._gauge_cls
                metric = gauge_cls(
                    name=PREFIX + name,
                    documentation=spec.doc,
                    labelnames=labels,
                    multiprocess_mode="mostrecent",
                )
            self._core[name] = metric

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx)
        for key, value in transfer_stats_data.items():
            parsed = parse_sample_key(key)
            if parsed is not None:
                spec, labels = parsed
                metric = self._core.get(spec.name)
                if metric is not None and engine is not None:
                    child = metric.labels(*engine, *labels)
                    if spec.kind is Kind.COUNTER:
                        child.inc(value)
                    else:
                        child.set(value)
            elif key in self._histograms:
                histogram = self._histograms[key].get(engine_idx)
                if histogram is not None:
                    for sample in value:
                        histogram.observe(sample)
            elif key in self._counters and value:
                counter = self._counters[key].get(engine_idx)
                if counter is not None:
                    counter.inc(value)
