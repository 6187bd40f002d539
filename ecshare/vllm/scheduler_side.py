"""The scheduler half of the connector: owns the region, the Producer and the Consumer.

Producer role: `update_state_after_alloc` reserves an ALLOCATED entry for each
item the engine will encode, and `build_plan` one for each item of a scheduled
request that the engine's own encoder cache still holds but the region lost
(the engine will not encode it again); the workers copy the encoder output in,
and the entry becomes READY only once they report that copy done (`saves`).
`request_finished` announces the request's READY entries and those whose copy
ran in a step that has completed, without waiting for the report.

Consumer role: `ensure_cache_available` fetches the items a request's
`ec_transfer_params` name, only from trusted producers (`settings`), and
defers the request until they are local; each fetched item is then held for
that request until its load has copied or the request ends. `has_cache_item`
pins what it reports present, in the same locked step as the lookup, and
`update_state_after_alloc` turns that pin into the load's (`pins`). Every pin
and every worker report is keyed by a grant id, never by mm_hash alone. A
fetch that fails for good leaves the item to local encoding when the request
carries its media, and fails the request through `take_unavailable_requests`
when it does not.

The engine-facing calls never block: fetches, reports and commits happen on
other threads, and the scheduler thread only reads their outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.metrics import SampleChanges, read_samples
from ecshare.peer import (
    Consumer,
    FailureReason,
    FetchFailed,
    FetchItem,
    Node,
    Producer,
    start_consumer,
    start_producer,
)
from ecshare.store import Entry, EntryMeta, EntryState, Store, StoreError
from ecshare.vllm.fetches import Fetch
from ecshare.vllm.metrics import CORE_METRICS
from ecshare.vllm.ops import LoadOp, StepPlan, StepReport, TransferParam, decode_param
from ecshare.vllm.pins import ENGINE_PIN_OWNER, EnginePins
from ecshare.vllm.reports import ReportListener
from ecshare.vllm.saves import SaveBook
from ecshare.vllm.settings import ConnectorSettings
from ecshare.vllm.tally import Tally

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Leases of the engine's pins are only a safety net, as each is released by a report or a
# request's end. Loads take `lease_s`; holds are renewed while their request lives, so a
# long queue wait is fine.
_HOLD_LEASE_S = 60.0
_RENEW_EVERY_S = _HOLD_LEASE_S / 4
_TORCH_ITEMSIZE = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8,
    "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
# The core metrics (region, grants, refusals, ...) are read at most this often: the
# stats are taken every engine step, and vLLM shows them on a scrape interval.
_CORE_STATS_INTERVAL_S = 1.0
_WARN_EVERY_S = 10.0
# How long a finished request waits for its workers' report (see `saves`); once one is
# this late, none waits again until a report arrives.
_REPORT_GRACE_S = 0.1

Shape = tuple[tuple[int, ...], str]  # (shape, dtype) of an encoder output


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


@dataclass
class _Waiter:
    """What the consumer side knows of one live request."""

    request: Request
    preemptions: int
    waiting: set[str] = field(default_factory=set)  # fetches in flight for it
    holds: dict[str, str] = field(default_factory=dict)  # mm_hash -> hold grant
    loaded: set[str] = field(default_factory=set)  # copied into the engine's encoder cache
    failed: set[str] = field(default_factory=set)  # left to local encoding
    bad_params: bool = False

    def feature(self, mm_hash: str) -> MultiModalFeatureSpec | None:
        return next((f for f in self.request.mm_features if f.identifier == mm_hash), None)


class SchedulerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        config: Config,
        *,
        produce: bool,
        consume: bool,
        settings: ConnectorSettings | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._settings = settings or ConnectorSettings()
        self._produce = produce
        self._consume = consume
        self._fingerprint = model_fingerprint(vllm_config)
        self._dtype = torch_dtype_name(vllm_config.model_config.dtype)
        self._tally = Tally()
        self._node = Node.create(config, "engine")
        self._store = self._node.store
        self._pins = EnginePins(self._store.table)
        self._saves = SaveBook(self._store, config, self._tally)
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        # vLLM drops the worker metadata of an encode-only instance; its workers
        # report on a side channel instead (see `reports`).
        self._listener: ReportListener | None = None
        try:
            if produce and not consume:
                self._listener = ReportListener(self._apply_saves)
            if produce:
                self.producer = start_producer(self._node, fingerprint=self._fingerprint)
            if consume:
                self.consumer = start_consumer(self._node, fingerprint=self._fingerprint)
        except BaseException:
            self.shutdown()
            raise
        self._plan = self._new_plan()
        self._save_tried: set[str] = set()  # this step's save plans, made or refused
        self._fetches: dict[str, Fetch] = {}  # mm_hash -> its fetch in flight
        self._waiters: dict[str, _Waiter] = {}  # request id -> state
        self._shapes: dict[str, Shape] = {}  # mm_hash -> what the model expects of it
        self._shape_refs: dict[str, int] = {}
        self._loads: dict[str, tuple[str, str]] = {}  # load grant -> (request id, mm_hash)
        self._unavailable: set[str] = set()
        # A fetch the consumer has not settled by its own longest deadline, and then some,
        # never will (its network thread is gone): the scheduler side gives up on it.
        self._overdue_s = config.fetch_deadline_max_s + config.request_timeout_s + 1.0
        self._reap_due = self._renew_due = 0.0
        self._reports_late = False
        self._warned_at: dict[str, float] = {}
        self._core_changes = SampleChanges(CORE_METRICS)
        self._core_due = 0.0
        if consume and not self._settings.trusted_producers:
            log.warning(
                "ecshare: no trusted_producers configured: this instance fetches from any "
                "producer endpoint a request names that authenticates with the producer key; "
                "list the encoders' endpoints in trusted_producers to refuse the others"
            )

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
        if self._pins.probed(identifier):
            return True
        pinned = self._pins.pin(identifier, "probe", self._config.lease_s)
        if pinned is None:
            return False
        grant, entry = pinned
        unfit = self._unfit(identifier, entry)
        if unfit is not None:
            self._pins.release(grant)
            self._drop_unfit(identifier, unfit)
            return False
        self._pins.add_probe(identifier, grant)
        return True

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.consumer is None:
            return True
        rid = request.request_id
        if rid in self._unavailable:
            return False  # failed at the end of this step: never schedule it
        waiter = self._waiters.get(rid) or self._track(request)
        if request.num_preemptions != waiter.preemptions:
            # Preempted: the engine dropped its copies, and the items are needed again.
            waiter.preemptions = request.num_preemptions
            waiter.loaded.clear()
        params = request.ec_transfer_params
        if not params:
            return True
        if not isinstance(params, dict):
            if not waiter.bad_params:
                waiter.bad_params = True
                self._tally.add("params_unusable")
                self._warn("params", f"request {rid}: ec_transfer_params is not an object")
            return True
        waiting = False
        for feature in request.mm_features:
            h = feature.identifier
            raw = params.get(h)
            if raw is None or h in waiter.holds or h in waiter.loaded or h in waiter.failed:
                continue
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already computed (a prefix-cache hit): nothing to fetch
            if h not in waiter.waiting and self._hold(waiter, h):
                continue  # already local
            fetch = self._fetches.get(h)
            if fetch is None:
                fetch = self._start_fetch(waiter, h, raw, feature)
                if fetch is None:
                    continue  # refused: left to local encoding
            fetch.requests.add(rid)
            waiter.waiting.add(h)
            if fetch.settled:
                self._settle(h, fetch)
            waiting |= h in waiter.waiting
        return not waiting and rid not in self._unavailable

    def _track(self, request: Request) -> _Waiter:
        waiter = _Waiter(request, request.num_preemptions)
        self._waiters[request.request_id] = waiter
        for feature in request.mm_features:
            h = feature.identifier
            self._shapes[h] = self._expected(feature)
            self._shape_refs[h] = self._shape_refs.get(h, 0) + 1
        return waiter

    def _hold(self, waiter: _Waiter, h: str) -> bool:
        """Pin the local READY entry of `h` for the request until its load has copied."""
        pinned = self._pins.pin(h, "hold", _HOLD_LEASE_S)
        if pinned is None:
            return False
        grant, entry = pinned
        unfit = self._unfit(h, entry)
        if unfit is not None:
            self._pins.release(grant)
            self._drop_unfit(h, unfit)
            return False
        waiter.holds[h] = grant
        return True

    def _start_fetch(
        self, waiter: _Waiter, h: str, raw: object, feature: MultiModalFeatureSpec
    ) -> Fetch | None:
        assert self.consumer is not None
        param = decode_param(raw)
        refusal: str | None = None
        if param is None or param.fingerprint != self._fingerprint:
            self._tally.add("params_unusable")
            refusal = "unusable ec_transfer_params"
        elif not self._settings.trusts(param.peer):
            self._tally.add("peer_refused")
            refusal = f"producer {param.peer!r} is not in trusted_producers"
            self._warn("peer", f"refused to fetch from {param.peer!r}: not a trusted producer")
        elif (unfit := self._unfit_param(param, feature)) is not None:
            self._tally.add("size_mismatch")
            refusal = unfit
        if refusal is not None:
            self._fall_back(waiter, h, refusal)
            return None
        assert param is not None
        item = FetchItem(h, nbytes=param.nbytes, max_nbytes=param.nbytes, peers=(param.peer,))
        try:
            future = self.consumer.fetch([item])[0]
        except Exception as exc:  # a consumer that cannot take work: encode instead
            self._fall_back(waiter, h, f"the consumer refused the fetch: {exc}")
            return None
        fetch = Fetch(
            h,
            future,
            pins=self._pins,
            lease_s=_HOLD_LEASE_S,
            check=lambda entry: self._unfit(h, entry),
            overdue_at=time.monotonic() + self._overdue_s,
            on_unfit=self._drop_unfit,
        )
        self._fetches[h] = fetch
        self._tally.add("fetches_started")
        return fetch

    def _settle_fetches(self) -> None:
        for h, fetch in list(self._fetches.items()):
            if fetch.settled:
                self._settle(h, fetch)

    def _settle(self, h: str, fetch: Fetch) -> None:
        """Hand a finished fetch's entry to each request waiting for it, or fall back."""
        self._fetches.pop(h, None)
        error = fetch.error
        self._account(h, fetch, error)
        hold = fetch.take_hold()
        for rid in fetch.requests:
            waiter = self._waiters.get(rid)
            if waiter is None or h not in waiter.waiting:
                continue
            waiter.waiting.discard(h)
            if error is not None:
                self._fall_back(waiter, h, str(error))
            elif not self._hold(waiter, h):
                # Only a removal can take an entry the fetch itself pins.
                self._fall_back(waiter, h, "removed from the region as it arrived")
        if hold is not None:
            self._pins.release(hold)

    def _account(self, h: str, fetch: Fetch, error: BaseException | None) -> None:
        if error is None:
            result = fetch.future.result()
            self._tally.add("fetched_items")
            self._tally.add("fetched_bytes", result.nbytes)
            self._tally.latency(result.latency_s)
            return
        self._tally.add("fetch_failed")
        if isinstance(error, FetchFailed) and error.reason is FailureReason.LOCAL_STORE_FULL:
            # The region's admission refused it rather than evict what requests hold.
            self._tally.add("fetch_region_full")
        log.warning("ecshare: fetch of %s failed (%s)", h, error)

    def _fall_back(self, waiter: _Waiter, h: str, why: str) -> None:
        """The item will not come from a producer: encode it here, or fail the request."""
        waiter.failed.add(h)
        rid = waiter.request.request_id
        feature = waiter.feature(h)
        if feature is not None and feature.data is None:
            # No media to encode from: only this request's failure is honest, and it
            # must not be scheduled, or the model would run without the item.
            log.error(
                "ecshare: failing request %s: encoder output %s could not be fetched (%s) "
                "and the request carries no media to encode it from",
                rid,
                h,
                why,
            )
            if rid not in self._unavailable:
                self._unavailable.add(rid)
                self._tally.add("requests_unavailable")
            return
        log.info("ecshare: encoding %s locally for request %s (%s)", h, rid, why)
        self._tally.add("local_encode_fallbacks")

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    # -- what the model expects --------------------------------------------------------------

    def _expected(self, feature: MultiModalFeatureSpec) -> Shape:
        num_embeds = int(feature.mm_position.get_num_embeds())
        return (num_embeds, self._output_width(feature.modality)), self._dtype

    def _unfit(self, h: str, entry: Entry) -> str | None:
        """Why `entry` cannot be the encoder output a live request expects for `h`, or None."""
        expected = self._shapes.get(h)
        found = (tuple(entry.meta.shape), entry.meta.dtype)
        if expected is None or found == expected:
            return None
        want = f"{expected[1]}{list(expected[0])}"
        return f"holds {found[1]}{list(found[0])}, the model expects {want}"

    def _unfit_param(self, param: TransferParam, feature: MultiModalFeatureSpec) -> str | None:
        shape, dtype = self._expected(feature)
        itemsize = _TORCH_ITEMSIZE.get(dtype, 0)
        if (tuple(param.shape), param.dtype) != (shape, dtype) or (
            itemsize and param.nbytes != itemsize * shape[0] * shape[1]
        ):
            return (
                f"params name {param.dtype}{list(param.shape)} ({param.nbytes} bytes), "
                f"the model expects {dtype}{list(shape)}"
            )
        return None

    def _drop_unfit(self, h: str, why: str) -> None:
        """An entry whose shape is wrong for the model is wrong for everyone: remove it."""
        self._tally.add("size_mismatch")
        self._warn("size", f"removing {h} from the region: it {why}")
        # Being written again meanwhile: that entry is checked when it is READY.
        with contextlib.suppress(StoreError):
            self._store.remove(h)

    # -- planning ----------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        h = feature.identifier
        if self._consume:
            grant = self._pins.take_probe(h)
            if grant is not None:
                self._plan_load(request.request_id, h, grant)
                return
            self._tally.add("local_encodes")  # the engine encodes it here
        if self._produce:
            self._plan_save(h, feature)

    def _plan_load(self, rid: str, h: str, grant: str) -> None:
        self._pins.renew(grant, self._config.lease_s)
        entry = self._pins.entry(grant)
        assert entry is not None  # pinned since has_cache_item: never evicted
        self._loads[grant] = (rid, h)
        self._plan.loads.append(
            LoadOp(grant, h, entry.extents, entry.nbytes, entry.meta.dtype, tuple(entry.meta.shape))
        )

    def _plan_save(self, h: str, feature: MultiModalFeatureSpec) -> None:
        if h in self._save_tried:
            return
        self._save_tried.add(h)
        shape, dtype = self._expected(feature)
        nbytes = shape[0] * shape[1] * _TORCH_ITEMSIZE.get(dtype, 2)
        if nbytes <= 0:
            return
        op = self._saves.plan(h, EntryMeta(dtype=dtype, shape=shape), nbytes)
        if op is not None:
            self._plan.saves[h] = op

    def _plan_saves_from_cache(self, out: SchedulerOutput) -> None:
        """Save the items of this step's new requests that the engine will take from its own
        encoder cache (it encodes nothing for them) while the region no longer holds them."""
        for new in out.scheduled_new_reqs:
            start = new.num_computed_tokens
            end = start + out.num_scheduled_tokens.get(new.req_id, 0)
            for feature in new.mm_features:
                position = feature.mm_position
                if position.offset >= end or position.offset + position.length <= start:
                    continue
                h = feature.identifier
                if h in self._save_tried or self._store.get(h) is not None:
                    continue
                self._plan_save(h, feature)
                if h in self._plan.saves:
                    self._tally.add("saves_from_cache")

    def _output_width(self, modality: str) -> int:
        widths = getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", {})
        if widths and modality in widths:
            return int(widths[modality])
        return int(self._vllm_config.model_config.get_hidden_size())

    def build_plan(self, out: SchedulerOutput | None = None) -> StepPlan:
        self._pins.release_probes()
        now = time.monotonic()
        if self._consume:
            self._settle_fetches()
            self._expire_overdue(now)
            self._keep_pins(now)
        if self._produce:
            if out is not None:
                self._plan_saves_from_cache(out)
            self._saves.abandon_overdue(now)
        self._save_tried = set()
        plan, self._plan = self._plan, self._new_plan()
        return plan

    def _expire_overdue(self, now: float) -> None:
        for h, fetch in list(self._fetches.items()):
            if now < fetch.overdue_at:
                continue
            why = f"the consumer gave no outcome in {self._overdue_s:g} s"
            if fetch.expire(why):
                self._tally.add("fetches_overdue")
                log.error(
                    "ecshare: fetch of %s overdue: %s; its network thread may have died, "
                    "and the item is encoded locally instead",
                    h,
                    why,
                )
            self._settle(h, fetch)

    def _keep_pins(self, now: float) -> None:
        """Renew the holds of live requests; on a consumer-only instance, reap expired pins
        (elsewhere the Producer's reaper does, for every owner)."""
        if now >= self._renew_due:
            self._renew_due = now + _RENEW_EVERY_S
            for waiter in self._waiters.values():
                for h, grant in list(waiter.holds.items()):
                    if not self._pins.renew(grant, _HOLD_LEASE_S):
                        del waiter.holds[h]  # reaped: found again, or fetched again, if needed
            for grant in [g for g in self._loads if self._pins.entry(g) is None]:
                del self._loads[grant]  # its report was lost and its pin reaped
        if self.producer is None and now >= self._reap_due:
            self._reap_due = now + self._config.reap_interval_s
            reaped = self._store.table.reap_expired(owner_prefix=ENGINE_PIN_OWNER)
            if reaped:
                self._tally.add("pins_reaped", len(reaped))
                log.warning("ecshare: %d pins reaped after their lease ran out", len(reaped))
                for _, grant in reaped:
                    self._loads.pop(grant, None)

    def _new_plan(self) -> StepPlan:
        route = self._listener.route if self._listener is not None else None
        return StepPlan(region=self._store.region.handle, report_to=route)

    # -- results -----------------------------------------------------------------------------

    def on_report(self, report: StepReport) -> None:
        """The workers' report of a step, from `update_connector_output`."""
        self._apply_saves(report)
        for grant in report.loaded | set(report.load_failed):
            self._pins.release(grant)
            rid, h = self._loads.pop(grant, ("", ""))
            waiter = self._waiters.get(rid)
            if waiter is None:
                continue
            hold = waiter.holds.pop(h, None)
            if hold is not None:
                self._pins.release(hold)
            if grant in report.loaded:
                waiter.loaded.add(h)
        self._tally.add("loaded_items", len(report.loaded))
        self._tally.add("load_failed", len(report.load_failed))
        for grant, why in report.load_failed.items():
            log.error("ecshare: the workers failed to load %s: %s", grant, why)

    def _apply_saves(self, report: StepReport) -> None:
        """The save half of a report, and its counters; on an encode-only instance, on the
        report listener's thread."""
        self._reports_late = False
        self._saves.apply(report)
        for key, value in report.counters.items():
            # Counters are integers: worker timings travel on in microseconds.
            if key.endswith("_seconds"):
                self._tally.add(key.removesuffix("_seconds") + "_us", round(value * 1e6))
            else:
                self._tally.add(key, int(value))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        if self.producer is None or not request.mm_features:
            return False, None
        if self._listener is not None and not self._reports_late:
            hashes = [f.identifier for f in request.mm_features]
            if not self._saves.await_reports(hashes, _REPORT_GRACE_S):
                self._reports_late = True
                log.warning(
                    "ecshare: no worker report for %s within %g s; finished requests no "
                    "longer wait for reports until one arrives",
                    hashes,
                    _REPORT_GRACE_S,
                )
        params: dict[str, Any] = {}
        for feature in request.mm_features:
            h = feature.identifier
            entry = self._store.get(h)
            if entry is None or entry.state is not EntryState.READY:
                entry = self._saves.saving(h)  # its copy ran in a step that has completed
            if entry is None:
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
        return False, params or None

    def _forget(self, rid: str) -> None:
        """A request ended: release what it held, and leave the fetches it waited for."""
        self._unavailable.discard(rid)
        waiter = self._waiters.pop(rid, None)
        if waiter is None:
            return
        for grant in waiter.holds.values():
            self._pins.release(grant)
        for h in waiter.waiting:
            fetch = self._fetches.get(h)
            if fetch is not None:
                fetch.requests.discard(rid)
                if not fetch.requests:
                    del self._fetches[h]
                    fetch.abandon()
                    self._tally.add("fetches_abandoned")
        for feature in waiter.request.mm_features:
            h = feature.identifier
            refs = self._shape_refs.get(h, 0) - 1
            if refs > 0:
                self._shape_refs[h] = refs
            else:
                self._shape_refs.pop(h, None)
                self._shapes.pop(h, None)

    # -- stats and shutdown ------------------------------------------------------------------

    def pending_fetches(self) -> int:
        """Fetches in flight for live requests (for tests and tools)."""
        return len(self._fetches)

    def saving(self, mm_hash: str) -> bool:
        """Whether a save of `mm_hash` awaits its worker report (for tests and tools)."""
        return self._saves.saving(mm_hash) is not None

    def take_stats(self) -> dict[str, Any]:
        counts, latencies = self._tally.take()
        data: dict[str, Any] = {k: v for k, v in counts.items() if v}
        if latencies:
            data["fetch_latency_s"] = latencies
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

    def _warn(self, kind: str, message: str) -> None:
        """Log a warning a hostile or broken client could repeat, at most once in a while."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[kind] = now
            log.warning("ecshare: %s (logged at most every %g s)", message, _WARN_EVERY_S)

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        if self.producer is not None:
            self.producer.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._node.close()
