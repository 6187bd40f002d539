"""The connector's stats as Prometheus metrics on vLLM's own `/metrics` endpoint.

vLLM passes each step's `ECShareStats` data to `observe()` in its frontend
process. The names start with `vllm:` so that vLLM's registry clean-up
(`unregister_vllm_metrics`) treats them as its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:ecshare_"

COUNTERS = {
    "fetches_started": "Fetches started for items named in a request's ec_transfer_params.",
    "fetched_items": "Items fetched from a producer into this instance's region.",
    "fetched_bytes": "Bytes fetched from producers over the data plane (NIXL).",
    "fetch_failed": "Fetches that failed for good (the item is then encoded locally).",
    "local_encode_fallbacks": "Items encoded locally because their fetch failed.",
    "requests_unavailable": "Requests failed because an item could be neither fetched nor encoded.",
    "params_unusable": "Items whose ec_transfer_params were malformed or incompatible.",
    "loaded_items": "Items copied from the region into the engine's encoder cache.",
    "load_failed": "Items whose copy into the encoder cache failed.",
    "saved_items": "Encoder outputs stored in the region and offered to consumers.",
    "saved_bytes": "Bytes of encoder output stored in the region.",
    "save_failed": "Encoder outputs the workers failed to store.",
    "save_skipped": "Encoder outputs not stored (region full, or too large).",
}
HISTOGRAMS = {
    "fetch_latency_s": (
        "fetch_latency_seconds",
        "Time from a fetch's start to its item being READY in the local region.",
    ),
}
_LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]


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
                buckets=_LATENCY_BUCKETS,
            )
            self._histograms[key] = self._per_engine(histogram)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._histograms:
                histogram = self._histograms[key].get(engine_idx)
                if histogram is not None:
                    for sample in value:
                        histogram.observe(sample)
            elif key in self._counters and value:
                counter = self._counters[key].get(engine_idx)
                if counter is not None:
                    counter.inc(value)
