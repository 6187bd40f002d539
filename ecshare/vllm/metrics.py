"""The connector's stats as Prometheus metrics on vLLM's own `/metrics` endpoint.

vLLM passes each step's `ECShareStats` data to `observe()` in its frontend
process. The names start with `vllm:` so that vLLM's registry clean-up
(`unregister_vllm_metrics`) treats them as its own.

Two kinds of data arrive: the connector's own counters (`COUNTERS`, the
fetch latency samples), and the core metrics of its Producer, Consumer and
store (`CORE_METRICS`, defined once in `ecshare.metrics`), which the
scheduler side reads in the engine process and ships as changes
(`SampleChanges`). Both appear as `vllm:ecshare_<name>`.
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
    "save_abandoned": "Saves given up because no worker report came within lease_s.",
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
}
HISTOGRAMS = {
    "fetch_latency_s": (
        "fetch_latency_seconds",
        "Time from a fetch's start to its item being READY in the local region.",
    ),
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
        for key, (name, doc) in HISTOGRAMS.items():
            histogram_cls: Any = self._histogram_cls
            histogram = histogram_cls(
                name=PREFIX + name,
                documentation=doc,
                labelnames=labelnames,
                buckets=list(LATENCY_BUCKETS_S),
            )
            self._histograms[key] = self._per_engine(histogram)
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
