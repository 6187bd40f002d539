"""The scheduler half of the connector: owns the region, the Producer and the Consumer.

Producer role: `update_state_after_alloc` reserves an ALLOCATED entry for each
item the engine will encode, and `build_plan` one for each item of a scheduled
request that the engine's own encoder cache still holds but the region lost
(the engine will not encode it again); the workers copy the encoder output in,
and the entry becomes READY only once they report that copy done (`saves`).
`request_finished` announces the request's READY entries and those whose copy
ran in a step that has completed (waiting for their report briefly at most),
each with its `modality` and the placeholder `metadata` and `item_indices` that
let a proxy send prefill/decode the request without its media (`placeholders`).
Where the request's own params ask for a push (`{"push_to": [...]}`), it pushes
each item to the allowed names and says so in the item's params (`pushed_to`;
`pushes`).

Consumer role: `ensure_cache_available` fetches the items a request's
`ec_transfer_params` name, only from trusted producers, and defers the request
until they are local; each fetched item is then held for that request until its
load has copied or the request ends (`waiting`); an item announced as pushed
here is waited for as a push, and pulled if the push does not land. With
`push_name` set, it opens its sessions to `trusted_producers` at start-up, so
that they can push before its first fetch. `has_cache_item`
pins what it reports present, in the same locked step as the lookup, and
`update_state_after_alloc` turns that pin into the load's (`pins`). Every pin
and every worker report is keyed by a grant id, never by mm_hash alone, and no
entry of another shape than the model computes is loaded (`shapes`).

The engine-facing calls never block: fetches, reports and commits happen on
other threads, and the scheduler thread only reads their outcomes. With
`events_port` set, the region's item events (an entry stored, an entry gone) go
to a proxy's item directory (`ecshare.peer.items`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.metrics import SampleChanges, read_samples
from ecshare.peer import Consumer, Node, Producer, start_consumer, start_producer
from ecshare.peer.items import ItemFeed, feed_from_config
from ecshare.store import EntryMeta, EntryState, Store
from ecshare.vllm.metrics import CORE_METRICS
from ecshare.vllm.ops import LoadOp, StepPlan, StepReport, TransferParam
from ecshare.vllm.pins import ENGINE_PIN_OWNER, EnginePins
from ecshare.vllm.placeholders import Placeholders
from ecshare.vllm.pushes import Pushes
from ecshare.vllm.reports import ReportListener
from ecshare.vllm.saves import LateReports, SaveBook
from ecshare.vllm.settings import ConnectorSettings
from ecshare.vllm.shapes import Expectations, torch_dtype_name
from ecshare.vllm.tally import Tally
from ecshare.vllm.waiting import WaitingRequests

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# The core metrics (region, grants, refusals, ...) are read at most this often: the
# stats are taken every engine step, and vLLM shows them on a scrape interval.
_CORE_STATS_INTERVAL_S = 1.0


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
        self,
        vllm_config: VllmConfig,
        config: Config,
        *,
        produce: bool,
        consume: bool,
        settings: ConnectorSettings | None = None,
    ) -> None:
        self._config = config
        self._settings = settings or ConnectorSettings()
        self._produce = produce
        self._consume = consume
        self._fingerprint = model_fingerprint(vllm_config)
        self._expect = Expectations(vllm_config)
        self._placeholders = Placeholders(vllm_config.model_config)
        self._tally = Tally()
        # A consume-only instance serves no reads: its node then runs no NIXL progress
        # thread, which would only compete with its own polls of TCP reads.
        self._node = Node.create(config, "engine" if produce else "consumer")
        self._store = self._node.store
        self._pins = EnginePins(self._store)
        self._saves = SaveBook(self._store, config, self._tally)
        self._late = LateReports(self._saves, self._tally)
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._pushes: Pushes | None = None
        self._waiting: WaitingRequests | None = None
        # vLLM drops the worker metadata of an encode-only instance; its workers
        # report on a side channel instead (see `reports`).
        self._listener: ReportListener | None = None
        self._feed: ItemFeed | None = None
        try:
            # Started before anything can commit, so that its mirror starts exact.
            self._feed = feed_from_config(self._store, config)
            if produce and not consume:
                self._listener = ReportListener(self._apply_saves)
            if produce:
                self.producer = start_producer(self._node, fingerprint=self._fingerprint)
                self._pushes = Pushes(self.producer, self._store, self._settings, self._tally)
            if consume:
                self.consumer = start_consumer(self._node, fingerprint=self._fingerprint)
                if self._settings.trusted_producers:
                    # Sessions opened now, not at the first fetch from each: a producer
                    # pushes only over a session we hold, tells it where each entry it
                    # commits from then on lies (direct reads), and its data plane is
                    # wired up before the first request needs it.
                    self.consumer.connect(self._settings.trusted_producers)
        except BaseException:
            self.shutdown()
            raise
        if self.consumer is not None:
            self._waiting = WaitingRequests(
                self.consumer,
                self._store,
                self._pins,
                self._expect,
                self._tally,
                config=config,
                settings=self._settings,
                fingerprint=self._fingerprint,
                placeholders=self._placeholders,
            )
            if not self._settings.trusted_producers:
                log.warning(
                    "ecshare: no trusted_producers configured: this instance fetches from any "
                    "producer endpoint a request names that authenticates with the producer "
                    "key; list the encoders' endpoints in trusted_producers to refuse the others"
                )
        self._plan = self._new_plan()
        self._save_tried: set[str] = set()  # this step's save plans, made or refused
        self._loads: dict[str, tuple[str, str]] = {}  # load grant -> (request id, mm_hash)
        self._reap_due = 0.0
        self._core_changes = SampleChanges(CORE_METRICS)
        self._core_due = 0.0

    @property
    def store(self) -> Store:
        """This instance's store (its region's entries), for tests and tools."""
        return self._store

    @property
    def feed(self) -> ItemFeed | None:
        """This instance's item events (`events_port`), for tests and tools."""
        return self._feed

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    # -- lookups -----------------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        if self._waiting is None:
            return False  # an encoder-only instance always encodes what it serves
        if self._pins.probed(identifier):
            return True
        pinned = self._pins.pin(identifier, "probe", self._config.engine_pin_s)
        if pinned is None:
            return False
        grant, entry = pinned
        unfit = self._expect.unfit(identifier, entry)
        if unfit is not None:
            self._pins.release(grant)
            self._waiting.drop_unfit(identifier, unfit)
            return False
        self._pins.add_probe(identifier, grant)
        return True

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._waiting is None:
            return True
        return self._waiting.ensure(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return self._waiting.take_unavailable() if self._waiting is not None else set()

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
        self._pins.renew(grant, self._config.engine_pin_s)
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
        expected = self._expect.of(feature)
        nbytes = self._expect.nbytes(expected)
        if nbytes <= 0:
            return
        op = self._saves.plan(h, EntryMeta(dtype=expected[1], shape=expected[0]), nbytes)
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

    def build_plan(self, out: SchedulerOutput | None = None) -> StepPlan:
        self._pins.release_probes()
        now = time.monotonic()
        if self._waiting is not None:
            self._waiting.tick(now)
            if self.producer is None:
                self._reap(now)
        if self._produce:
            if out is not None:
                self._plan_saves_from_cache(out)
            self._saves.abandon_overdue(now)
            if self._pushes is not None:
                self._pushes.on_saves_applied()
        self._save_tried = set()
        plan, self._plan = self._plan, self._new_plan()
        return plan

    def _reap(self, now: float) -> None:
        """Reap the engine's expired pins, on an instance with no Producer to do it."""
        if now < self._reap_due:
            return
        self._reap_due = now + self._config.reap_interval_s
        reaped = self._store.reap_expired(owner_prefix=ENGINE_PIN_OWNER)
        if reaped:
            self._tally.add("pins_reaped", len(reaped))
            log.warning("ecshare: %d pins reaped after their lease ran out", len(reaped))
        for grant in [g for g in self._loads if self._pins.entry(g) is None]:
            del self._loads[grant]  # its report was lost and its pin reaped

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
            if self._waiting is not None:
                self._waiting.loaded(rid, h, copied=grant in report.loaded)
        self._tally.add("loaded_items", len(report.loaded))
        self._tally.add("load_failed", len(report.load_failed))
        for grant, why in report.load_failed.items():
            log.error("ecshare: the workers failed to load %s: %s", grant, why)

    def _apply_saves(self, report: StepReport) -> None:
        """The save half of a report, and its counters; on an encode-only instance, on the
        report listener's thread."""
        with self._late.applying():
            self._saves.apply(report)
            if self._pushes is not None and report.saved:
                self._pushes.on_saves_applied()
            for key, value in report.counters.items():
                # Counters are integers: worker timings travel on in microseconds.
                if key.endswith("_seconds"):
                    self._tally.add(key.removesuffix("_seconds") + "_us", round(value * 1e6))
                else:
                    self._tally.add(key, int(value))

    def keeps_stepping(self) -> bool:
        """Whether an encode-only engine with no request left must step on (vLLM's
        `has_pending_push_work`): while a save awaits its workers' report, and until a
        step has taken the counts of the last report applied, for `STEP_ON_S` at most
        (`ecshare.vllm.saves.LateReports`).
        """
        if self._listener is None:
            return False  # reports arrive in the step's own output
        return self._late.keeps_stepping()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._waiting is not None:
            self._waiting.forget(request.request_id)
        if self.producer is None or not request.mm_features:
            return False, None
        if self._listener is not None:
            self._late.await_reports([f.identifier for f in request.mm_features])
        params: dict[str, Any] = {}
        items = self._placeholders.item_params(request.mm_features)
        push_to = (
            self._pushes.names_for(request.request_id, request.ec_transfer_params)
            if self._pushes is not None
            else ()
        )
        for feature in request.mm_features:
            h = feature.identifier
            if h in params:
                continue  # a repeated item: one entry, all its indices in item_indices
            entry = self._store.get(h)
            if entry is None or entry.state is not EntryState.READY:
                entry = self._saves.saving(h)  # its copy ran in a step that has completed
            if entry is None:
                # Metadata without an entry would let a proxy drop the media of an item
                # that no consumer can fetch: such an item is not announced at all.
                continue
            item = items.get(h, {})
            pushed_to = push_to if self._pushes is not None else ()
            if pushed_to and self._pushes is not None:
                self._pushes.push(h, pushed_to)
            where = TransferParam(
                peer=self.producer.address,
                fingerprint=self._fingerprint,
                nbytes=entry.nbytes,
                dtype=entry.meta.dtype,
                shape=tuple(entry.meta.shape),
                modality=feature.modality,
                metadata=item.get("metadata", {}),
                item_indices=tuple(item.get("item_indices", ())),
                pushed_to=pushed_to,
            )
            # As JSON gives it (lists, not tuples): what vLLM's answer and a consumer see.
            params[h] = msgspec.json.decode(msgspec.json.encode(where))
        return False, params or None

    # -- stats and shutdown ------------------------------------------------------------------

    def pending_fetches(self) -> int:
        """Fetches in flight for live requests (for tests and tools)."""
        return self._waiting.pending_fetches() if self._waiting is not None else 0

    def saving(self, mm_hash: str) -> bool:
        """Whether a save of `mm_hash` awaits its worker report (for tests and tools)."""
        return self._saves.saving(mm_hash) is not None

    def take_stats(self) -> dict[str, Any]:
        counts, latencies = self._late.take()  # never inside a report being applied
        data: dict[str, Any] = {k: v for k, v in counts.items() if v}
        data.update(latencies)
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
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        self._node.close()
