"""The scheduler half of the connector: owns the region, the Producer and the Consumer.

Producer role: `update_state_after_alloc` reserves an ALLOCATED entry for each
item the engine will encode; the workers copy the encoder output into it;
`update_connector_output` marks it READY only once the workers report the copy
done. `request_finished` announces only entries that are READY, or whose copy
the workers finished in this very step (their commit happens before vLLM sends
the response; a copy that failed is withdrawn from the params again). A copy
whose report never comes is given up a lease after it began, and its blocks
return to the region.

Consumer role: `ensure_cache_available` starts fetches for items the request's
`ec_transfer_params` name and defers the request until they are local.
`has_cache_item` is true only for READY local entries, which are pinned while
the workers copy them into the engine's encoder cache. A fetch that fails for
good leaves the item to local encoding when the request carries its media,
and fails the request through `take_unavailable_requests` when it does not.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.metrics import SampleChanges, read_samples
from ecshare.peer import (
    Consumer,
    FetchFailed,
    FetchItem,
    FetchResult,
    Node,
    Producer,
    start_consumer,
    start_producer,
)
from ecshare.store import (
    EntryExists,
    EntryMeta,
    EntryState,
    NotFound,
    NotReady,
    Store,
    StoreFull,
)
from ecshare.vllm.metrics import CORE_METRICS
from ecshare.vllm.ops import LoadOp, SaveOp, StepPlan, StepReport, TransferParam, decode_param
from ecshare.vllm.reports import ReportInbox

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Local pins held while workers copy an entry into the encoder cache. The lease
# only matters if a report is lost; the normal release is the worker's report.
_LOAD_PIN_OWNER = "ecshare.vllm.load"
_LOAD_LEASE_S = 120.0
_TORCH_ITEMSIZE = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8,
    "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
# The core metrics (region, grants, refusals, ...) are read at most this often: the
# stats are taken every engine step, and vLLM shows them on a scrape interval.
_CORE_STATS_INTERVAL_S = 1.0


def torch_dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def model_fingerprint(vllm_config: VllmConfig) -> str:
    mc = vllm_config.model_config
    vision = getattr(mc.hf_config, "vision_config", None)
    encoder_config: dict[str, Any] = {}
    if vision is not None and hasattr(vision, "to_dict"):
        encoder_config = {
            k: v for k, v in vision.to_dict().items() if isinstance(v, int | float | str | bool)
        }
    return p.fingerprint(
        model_id=str(mc.model),
        model_revision=str(mc.revision or ""),
        encoder_config=encoder_config,
        dtype=torch_dtype_name(mc.dtype),
        hidden_size=int(mc.get_hidden_size()),
    )


class SchedulerSide:
    def __init__(
        self, vllm_config: VllmConfig, config: Config, *, produce: bool, consume: bool
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._produce = produce
        self._consume = consume
        self._fingerprint = model_fingerprint(vllm_config)
        self._dtype = torch_dtype_name(vllm_config.model_config.dtype)
        self._node = Node.create(config, "engine")
        self._store = self._node.store
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        # vLLM drops the worker metadata of an encode-only instance; its workers
        # report on a side channel instead (see `reports`).
        self._inbox: ReportInbox | None = None
        try:
            if produce and not consume:
                self._inbox = ReportInbox()
            if produce:
                self.producer = start_producer(self._node, fingerprint=self._fingerprint)
            if consume:
                self.consumer = start_consumer(self._node, fingerprint=self._fingerprint)
        except BaseException:
            self.shutdown()
            raise
        self._plan = self._new_plan()
        # mm_hash -> (its ALLOCATED Entry, when the copy is given up if unreported)
        self._pending_saves: dict[str, tuple[Any, float]] = {}
        self._announced: dict[str, list[dict[str, Any]]] = {}  # params dicts awaiting commit
        self._fetches: dict[str, Future[FetchResult]] = {}
        # Per request, the items whose fetch has been decided (arrived, failed or
        # already local): never fetched again for it, so that a failed item does
        # not stall each later step of the request with another fetch.
        self._settled: dict[str, set[str]] = {}
        self._unavailable: set[str] = set()
        self._load_pins: dict[str, list[str]] = {}  # mm_hash -> grant ids
        self._grant_ids = itertools.count(1)
        self.counters: Counter[str] = Counter()
        self.fetch_latencies: list[float] = []
        self._core_changes = SampleChanges(CORE_METRICS)
        self._core_due = 0.0

    @property
    def store(self) -> Store:
        """This instance's store (its region's entries), for tests and tools."""
        return self._store

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    # -- lookups -----------------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        if not self._consume:
            return False  # an encoder-only instance always encodes what it serves
        entry = self._store.table.get(identifier)
        return entry is not None and entry.state is EntryState.READY

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.consumer is None or not request.ec_transfer_params:
            return True
        rid = request.request_id
        if rid in self._unavailable:
            return False  # failed at the end of this step: never schedule it
        params = request.ec_transfer_params
        settled = self._settled.setdefault(rid, set())
        waiting = False
        for feature in request.mm_features:
            h = feature.identifier
            raw = params.get(h)
            if raw is None or h in settled:
                continue
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already computed (a prefix-cache hit): nothing to fetch
            future = self._fetches.get(h)
            if future is None:
                if self.has_cache_item(h):
                    settled.add(h)
                    continue
                future = self._start_fetch(h, raw)
            if not future.done():
                waiting = True
                continue
            settled.add(h)
            if self._fetches.pop(h, None) is not None:
                self._account(h, future)
            exc = future.exception()
            if exc is None or self.has_cache_item(h):
                continue
            if feature.data is None:
                # No media to encode from: only this request's failure is honest,
                # and it must not be scheduled, or the model would run without
                # the item's embeddings.
                log.error(
                    "ecshare: failing request %s: encoder output %s could not be fetched (%s) "
                    "and the request carries no media to encode it from",
                    rid,
                    h,
                    exc,
                )
                self._unavailable.add(rid)
                self.counters["requests_unavailable"] += 1
                return False
            log.info("ecshare: encoding %s locally for request %s (%s)", h, rid, exc)
            self.counters["local_encode_fallbacks"] += 1
        return not waiting

    def _start_fetch(self, h: str, raw: object) -> Future[FetchResult]:
        assert self.consumer is not None
        param = decode_param(raw)
        if param is None or param.fingerprint != self._fingerprint:
            self.counters["params_unusable"] += 1
            future = self._failed(h, "unusable ec_transfer_params")
        else:
            item = FetchItem(h, nbytes=param.nbytes, peers=(param.peer,))
            future = self.consumer.fetch([item])[0]
            self.counters["fetches_started"] += 1
        self._fetches[h] = future
        return future

    def _account(self, h: str, future: Future[FetchResult]) -> None:
        exc = future.exception()
        if exc is None:
            result = future.result()
            self.counters["fetched_items"] += 1
            self.counters["fetched_bytes"] += result.nbytes
            self.fetch_latencies.append(result.latency_s)
        else:
            self.counters["fetch_failed"] += 1
            log.warning("ecshare: fetch of %s failed (%s)", h, exc)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    # -- planning ----------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        h = feature.identifier
        entry = self._store.table.get(h)
        if self._consume and entry is not None and entry.state is EntryState.READY:
            self._plan_load(h)
            return
        if self._produce:
            self._plan_save(h, feature)

    def _plan_load(self, h: str) -> None:
        grant = f"load-{next(self._grant_ids)}"
        try:
            pin = self._store.table.pin(h, _LOAD_PIN_OWNER, grant, _LOAD_LEASE_S)
        except (NotFound, NotReady):
            return  # evicted since has_cache_item: the engine will fail this item's load
        entry = self._store.table.pinned_entry(_LOAD_PIN_OWNER, grant)
        assert entry is not None and pin.mm_hash == h
        self._load_pins.setdefault(h, []).append(grant)
        self._plan.loads.append(
            LoadOp(
                h,
                tuple(entry.byte_extents(self._store.block_size)),
                entry.nbytes,
                entry.meta.dtype,
                tuple(entry.meta.shape),
            )
        )

    def _plan_save(self, h: str, feature: Any) -> None:
        if h in self._pending_saves or self._store.table.get(h) is not None:
            return  # already stored or being stored: never twice
        width = self._output_width(feature.modality)
        num_embeds = int(feature.mm_position.get_num_embeds())
        itemsize = _TORCH_ITEMSIZE.get(self._dtype, 2)
        nbytes = num_embeds * width * itemsize
        if nbytes <= 0:
            return
        meta = EntryMeta(dtype=self._dtype, shape=(num_embeds, width))
        try:
            entry = self._store.allocate(h, nbytes, meta)
        except (StoreFull, EntryExists, ValueError) as exc:
            self.counters["save_skipped"] += 1
            log.warning("ecshare: not saving %s: %s", h, exc)
            return
        self._pending_saves[h] = (entry, time.monotonic() + self._config.lease_s)
        self._plan.saves[h] = SaveOp(h, tuple(entry.byte_extents(self._store.block_size)), nbytes)

    def _output_width(self, modality: str) -> int:
        widths = getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", {})
        if widths and modality in widths:
            return int(widths[modality])
        return int(self._vllm_config.model_config.get_hidden_size())

    def build_plan(self) -> StepPlan:
        if self._inbox is not None:
            self._apply_reports(0.0)
        if self._pending_saves:
            self._abandon_unreported_saves(time.monotonic())
        plan, self._plan = self._plan, self._new_plan()
        return plan

    def _abandon_unreported_saves(self, now: float) -> None:
        """Free the entries of copies the workers never reported, a lease after they began.

        A report comes at the end of the step that made the copy; one missing for a whole
        lease is lost (a worker that died, a dropped message), and without this its
        ALLOCATED entry would hold its blocks for good. A report that still arrives later
        finds nothing pending and is ignored.
        """
        for h, (entry, give_up_at) in list(self._pending_saves.items()):
            if give_up_at > now:
                break  # oldest first: the rest began later
            del self._pending_saves[h]
            self._store.abort(entry)
            self._withdraw(h, f"no worker report within lease_s ({self._config.lease_s:g} s)")
            self.counters["save_abandoned"] += 1

    def _new_plan(self) -> StepPlan:
        route = self._inbox.route if self._inbox is not None else None
        return StepPlan(region=self._store.region.handle, report_to=route)

    def _apply_reports(self, timeout_s: float) -> None:
        assert self._inbox is not None
        for report in self._inbox.receive(timeout_s):
            self.on_report(report)

    def _await_saves(self, hashes: list[str]) -> None:
        """Apply reports until none of `hashes` is still being copied by the workers.

        A request finishes only after the step that encoded it has returned, and
        the workers sent their report before returning, so it is at most in
        flight; the wait is bounded all the same.
        """
        deadline = time.monotonic() + self._config.request_timeout_s
        self._apply_reports(0.0)
        while any(h in self._pending_saves for h in hashes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("ecshare: no worker report for %s in time", hashes)
                return
            self._apply_reports(remaining)

    # -- results -----------------------------------------------------------------------------

    def on_report(self, report: StepReport) -> None:
        for h, (dtype, shape) in report.saved.items():
            pending = self._pending_saves.pop(h, None)
            if pending is None:
                continue
            entry = pending[0]
            if (dtype, tuple(shape)) != (entry.meta.dtype, tuple(entry.meta.shape)):
                self._withdraw(h, f"worker saved {dtype}{list(shape)}")
                self._store.abort(entry)
                continue
            checksum = self._store.checksum(entry) if self._config.checksum != "none" else None
            self._store.table.commit(h, expect=entry, checksum=checksum)
            self.counters["saved_items"] += 1
            self.counters["saved_bytes"] += entry.nbytes
            self._announced.pop(h, None)
        for h, why in report.save_failed.items():
            pending = self._pending_saves.pop(h, None)
            if pending is not None:
                self._store.abort(pending[0])
            self._withdraw(h, why)
            self.counters["save_failed"] += 1
        for h in report.loaded | set(report.load_failed):
            for grant in self._load_pins.pop(h, []):
                self._store.table.unpin(_LOAD_PIN_OWNER, grant)
        self.counters["loaded_items"] += len(report.loaded)
        self.counters["load_failed"] += len(report.load_failed)
        for key, value in report.counters.items():
            # Counters are integers: worker timings travel on in microseconds.
            if key.endswith("_seconds"):
                self.counters[key.removesuffix("_seconds") + "_us"] += round(value * 1e6)
            else:
                self.counters[key] += int(value)

    def _withdraw(self, h: str, why: str) -> None:
        log.warning("ecshare: encoder output %s not stored (%s); withdrawn from params", h, why)
        for params in self._announced.pop(h, []):
            params.pop(h, None)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._settled.pop(request.request_id, None)
        if self.producer is None or not request.mm_features:
            return False, None
        if self._inbox is not None:
            self._await_saves([f.identifier for f in request.mm_features])
        params: dict[str, Any] = {}
        for feature in request.mm_features:
            h = feature.identifier
            entry = self._store.table.get(h)
            pending = h in self._pending_saves
            if entry is None or not (entry.state is EntryState.READY or pending):
                continue
            params[h] = msgspec.to_builtins(
                TransferParam(
                    peer=self.producer.address,
                    fingerprint=self._fingerprint,
                    nbytes=entry.nbytes,
                    dtype=entry.meta.dtype,
                    shape=tuple(entry.meta.shape),
                )
            )
            if pending:
                self._announced.setdefault(h, []).append(params)
        return False, params or None

    # -- stats and shutdown ------------------------------------------------------------------

    def take_stats(self) -> dict[str, Any]:
        data: dict[str, Any] = dict(self.counters)
        self.counters.clear()
        if self.fetch_latencies:
            data["fetch_latency_s"] = list(self.fetch_latencies)
            self.fetch_latencies = []
        now = time.monotonic()
        if now >= self._core_due:
            self._core_due = now + _CORE_STATS_INTERVAL_S
            samples = read_samples(
                [self._store],
                [self.producer] if self.producer is not None else [],
                [self.consumer] if self.consumer is not None else [],
            )
            data.update(self._core_changes.take(samples))
        return data

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        if self.producer is not None:
            self.producer.stop()
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        self._node.close()

    @staticmethod
    def _failed(h: str, why: str) -> Future[FetchResult]:
        from ecshare.peer.transfer import FailureReason

        future: Future[FetchResult] = Future()
        future.set_exception(FetchFailed(h, FailureReason.INCOMPATIBLE, why))
        return future
