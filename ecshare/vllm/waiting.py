"""The consumer side's live requests: fetches on their behalf, holds, and fallbacks.

For each item a request's `ec_transfer_params` name, `ensure` (vLLM's
`ensure_cache_available`) does one of three things, and the request is
deferred while any fetch it needs is in flight:

    already local --------------------------------> held for the request
    params usable, producer trusted --fetch--> done: held for the request
                                             \\--> failed: fall back
    params unusable, untrusted, wrong shape ------> fall back (counted)

A hold pins the item for the request until its load has copied (`loaded`) or
the request ends (`forget`); a preempted request, whose copies the engine
dropped, gets its items again the same way. Falling back means encoding the
item locally when the request carries its media, and failing the request
(`take_unavailable`) when it does not: only that is honest, as the model must
never run without the item. A request may carry an item as placeholder
metadata only (media-free prefill/decode, `placeholders`): such an item is
counted (`media_free_items`), and one that no params name and the region does
not hold fails the request at once.

Push (docs/PUSH.md): an item whose params list this instance's `push_name` in
`pushed_to` was pushed here by its encoder, or is being pushed. Its fetch says
so (`FetchItem.pushed`): the consumer waits for the push, up to `push_wait_s`
for the offer and then the push's own deadline, and pulls if the push is
refused, fails or is late; the request waits meanwhile, as for any fetch. Such
an item goes through the consumer even when it is already local, so that a
push that landed before the scheduler asked is seen as pushed. An item of a
push reserved here and not over (`Consumer.push_pending`) keeps its request
waiting even where no params name it; it is looked up again on the next step.

Every fetch records its exposed latency, from the scheduler asking for the item
to the entry being local: `exposed_pushed_s` when the producer wrote it here,
`exposed_pulled_s` when it was read from the producer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ecshare.config import Config
from ecshare.peer import Consumer, FailureReason, FetchFailed, FetchItem
from ecshare.protocol import TransferParam
from ecshare.store import Store, StoreError
from ecshare.vllm.fetches import Fetch
from ecshare.vllm.ops import decode_param
from ecshare.vllm.pins import EnginePins
from ecshare.vllm.placeholders import Placeholders
from ecshare.vllm.settings import ConnectorSettings
from ecshare.vllm.shapes import Expectations
from ecshare.vllm.tally import Tally

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

LOCAL = "local"  # FetchResult.peer of an item found in the region

# Holds are renewed while their request lives, so a long wait in the queue is fine; the
# lease only ends the holds of bookkeeping that was lost.
HOLD_LEASE_S = 60.0
_RENEW_EVERY_S = HOLD_LEASE_S / 4


@dataclass
class Waiter:
    """What the consumer side knows of one live request."""

    request: Request
    preemptions: int
    waiting: set[str] = field(default_factory=set)  # fetches in flight for it
    holds: dict[str, str] = field(default_factory=dict)  # mm_hash -> hold grant
    loaded: set[str] = field(default_factory=set)  # copied into the engine's encoder cache
    failed: set[str] = field(default_factory=set)  # left to local encoding
    media_free: set[str] = field(default_factory=set)  # came as placeholder metadata only
    bad_params: bool = False


class WaitingRequests:
    def __init__(
        self,
        consumer: Consumer,
        store: Store,
        pins: EnginePins,
        expect: Expectations,
        tally: Tally,
        *,
        config: Config,
        settings: ConnectorSettings,
        fingerprint: str,
        placeholders: Placeholders | None = None,
    ) -> None:
        self._consumer = consumer
        self._placeholders = placeholders
        self._store = store
        self._pins = pins
        self._expect = expect
        self._tally = tally
        self._settings = settings
        self._fingerprint = fingerprint
        self._push_name = config.push_name
        self._waiters: dict[str, Waiter] = {}  # request id -> state
        self._fetches: dict[str, Fetch] = {}  # mm_hash -> its fetch in flight
        self._unavailable: set[str] = set()
        # A fetch the consumer has not settled by its own longest deadline, and then some,
        # never will (its network thread hangs): it is given up.
        self._overdue_s = config.fetch_deadline_max_s + config.request_timeout_s + 1.0
        self._config = config
        self._renew_due = 0.0

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether every item the request needs from a producer is local (and held for it)."""
        rid = request.request_id
        if rid in self._unavailable:
            return False  # failed at the end of this step: never schedule it
        waiter = self._waiters.get(rid) or self._track(request)
        if request.num_preemptions != waiter.preemptions:
            # Preempted: the engine dropped its copies, and the items are needed again.
            waiter.preemptions = request.num_preemptions
            waiter.loaded.clear()
        params = request.ec_transfer_params
        if not params and not waiter.media_free:
            return not self._push_pending(request, num_computed_tokens)
        if params and not isinstance(params, dict):
            if not waiter.bad_params:
                waiter.bad_params = True
                self._tally.add("params_unusable")
                self._tally.warn("params", f"request {rid}: ec_transfer_params is not an object")
            params = None
        waiting = False
        for feature in request.mm_features:
            h = feature.identifier
            if h in waiter.holds or h in waiter.loaded or h in waiter.failed:
                continue
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already computed (a prefix-cache hit): nothing to fetch
            raw = params.get(h) if params else None
            if raw is None:
                if self._consumer.push_pending(h):
                    waiting = True  # being pushed here: looked up again next step
                elif h in waiter.media_free and not self._hold(waiter, h):
                    self._fall_back(waiter, h, "no ec_transfer_params name it")
                continue
            param = decode_param(raw)
            pushed = self._pushed_here(param)
            if h not in waiter.waiting and not pushed and self._hold(waiter, h):
                continue  # already local
            fetch = self._fetches.get(h)
            if fetch is None:
                fetch = self._start_fetch(waiter, h, param, feature, pushed=pushed)
                if fetch is None:
                    continue  # refused: left to local encoding
            fetch.requests.add(rid)
            waiter.waiting.add(h)
            if fetch.settled:
                self._settle(h, fetch)
            waiting |= h in waiter.waiting
        return not waiting and rid not in self._unavailable

    def _push_pending(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether a push of one of the request's items not yet computed is in flight."""
        return any(
            self._consumer.push_pending(f.identifier)
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        )

    def _push_wait_s(self, nbytes: int) -> float:
        """How much longer than a pull the consumer may take where it waits for a push
        first (announced, or one it reserved): the offer, then the push's deadline."""
        if self._push_name is None:
            return 0.0
        c = self._config
        return c.push_wait_s + c.push_deadline_s + c.fetch_deadline_per_gib_s * nbytes / (1 << 30)

    def _pushed_here(self, param: TransferParam | None) -> bool:
        """Whether an item's params say its encoder pushes it to this instance (params
        that did not decode, `pushed_to` included, say nothing: `_start_fetch` counts them)."""
        return (
            self._push_name is not None and param is not None and self._push_name in param.pushed_to
        )

    def _track(self, request: Request) -> Waiter:
        waiter = Waiter(request, request.num_preemptions)
        self._waiters[request.request_id] = waiter
        for feature in request.mm_features:
            self._expect.add(feature)
            if not self._carries_input(feature):
                waiter.media_free.add(feature.identifier)
        if waiter.media_free:
            self._tally.add("media_free_items", len(waiter.media_free))
        return waiter

    def _carries_input(self, feature: MultiModalFeatureSpec) -> bool:
        if self._placeholders is None:
            return feature.data is not None
        return self._placeholders.carries_input(feature)

    def _hold(self, waiter: Waiter, h: str) -> bool:
        """Pin the local READY entry of `h` for the request until its load has copied."""
        pinned = self._pins.pin(h, "hold", HOLD_LEASE_S)
        if pinned is None:
            return False
        grant, entry = pinned
        unfit = self._expect.unfit(h, entry)
        if unfit is not None:
            self._pins.release(grant)
            self.drop_unfit(h, unfit)
            return False
        waiter.holds[h] = grant
        return True

    def _start_fetch(
        self,
        waiter: Waiter,
        h: str,
        param: TransferParam | None,
        feature: MultiModalFeatureSpec,
        *,
        pushed: bool = False,
    ) -> Fetch | None:
        refusal: str | None = None
        if (
            param is None
            or param.fingerprint != self._fingerprint
            or param.modality not in (None, feature.modality)
        ):
            self._tally.add("params_unusable")
            refusal = "unusable ec_transfer_params"
        elif not self._settings.trusts(param.peer):
            self._tally.add("peer_refused")
            refusal = f"producer {param.peer!r} is not in trusted_producers"
            self._tally.warn("peer", f"refused to fetch from {param.peer!r}: not trusted")
        elif (unfit := self._expect.unfit_param(param, feature)) is not None:
            self._tally.add("size_mismatch")
            refusal = unfit
        if refusal is not None:
            self._fall_back(waiter, h, refusal)
            return None
        assert param is not None
        hold = self._pins.hold("fetch", HOLD_LEASE_S)
        item = FetchItem(
            h,
            nbytes=param.nbytes,
            max_nbytes=param.nbytes,
            peers=(param.peer,),
            hold=hold,
            pushed=pushed,
        )
        started_at = time.monotonic()
        try:
            future = self._consumer.fetch([item])[0]
        except Exception as exc:  # a consumer that cannot take work: encode instead
            self._fall_back(waiter, h, f"the consumer refused the fetch: {exc}")
            return None
        fetch = Fetch(
            h,
            future,
            pins=self._pins,
            hold=hold,
            check=lambda entry: self._expect.unfit(h, entry),
            overdue_at=started_at + self._overdue_s + self._push_wait_s(param.nbytes),
            on_unfit=self.drop_unfit,
            started_at=started_at,
            pushed=pushed,
        )
        self._fetches[h] = fetch
        self._tally.add("fetches_started")
        if pushed:
            self._tally.add("push_announced")
        return fetch

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
            exposed_s = max(0.0, fetch.done_at - fetch.started_at)
            if result.pushed:
                self._tally.add_all({"push_received": 1, "push_received_bytes": result.nbytes})
                self._tally.sample("exposed_pushed_s", exposed_s)
            elif result.peer != LOCAL:
                self._tally.add_all(
                    {
                        "fetched_items": 1,
                        "fetched_bytes": result.nbytes,
                        # No request was sent for it: read where its producer said.
                        "fetched_direct_items": int(result.attempts == 0),
                    }
                )
                self._tally.sample("fetch_latency_s", result.latency_s)
                self._tally.sample("exposed_pulled_s", exposed_s)
            return
        self._tally.add("fetch_failed")
        if isinstance(error, FetchFailed) and error.reason is FailureReason.LOCAL_STORE_FULL:
            # The region's admission refused it rather than evict what requests hold.
            self._tally.add("fetch_region_full")
        log.warning("ecshare: fetch of %s failed (%s)", h, error)

    def _fall_back(self, waiter: Waiter, h: str, why: str) -> None:
        """The item will not come from a producer: encode it here, or fail the request."""
        waiter.failed.add(h)
        rid = waiter.request.request_id
        if h in waiter.media_free:
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

    def drop_unfit(self, h: str, why: str) -> None:
        """An entry whose shape is wrong for the model is wrong for everyone: remove it."""
        self._tally.add("size_mismatch")
        self._tally.warn("size", f"removing {h} from the region: it {why}")
        # Being written again meanwhile: that entry is checked when it is READY.
        with contextlib.suppress(StoreError):
            self._store.remove(h)

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    # -- results and time --------------------------------------------------------------------

    def loaded(self, rid: str, h: str, *, copied: bool) -> None:
        """The workers reported the load of `h` for request `rid`: its hold is done."""
        waiter = self._waiters.get(rid)
        if waiter is None:
            return
        hold = waiter.holds.pop(h, None)
        if hold is not None:
            self._pins.release(hold)
        if copied:
            waiter.loaded.add(h)

    def tick(self, now: float) -> None:
        """Once a step: settle finished fetches, give up overdue ones, renew holds."""
        for h, fetch in list(self._fetches.items()):
            if fetch.settled:
                self._settle(h, fetch)
            elif now >= fetch.overdue_at:
                why = f"the consumer gave no outcome in {self._overdue_s:g} s"
                if fetch.expire(why):
                    self._tally.add("fetches_overdue")
                    log.error(
                        "ecshare: fetch of %s overdue: %s; its network thread may hang, "
                        "and the item is encoded locally instead",
                        h,
                        why,
                    )
                self._settle(h, fetch)
        if now >= self._renew_due:
            self._renew_due = now + _RENEW_EVERY_S
            for waiter in self._waiters.values():
                for h, grant in list(waiter.holds.items()):
                    if not self._pins.renew(grant, HOLD_LEASE_S):
                        del waiter.holds[h]  # reaped: found again, or fetched again, if needed

    def forget(self, rid: str) -> None:
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
            self._expect.discard(feature)

    def pending_fetches(self) -> int:
        return len(self._fetches)
