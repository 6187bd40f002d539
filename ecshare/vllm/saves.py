"""The producer's saves in flight: ALLOCATED entries the workers are filling. Thread-safe.

    planned (ALLOCATED, grant g) --report saved[g]--> READY (announced from then on)
                    |            --report save_failed[g]--> freed
                    \\--no report within save_report_timeout_s--> freed (save_abandoned)

Each save has a grant id of its own, and only a report naming that grant
commits or frees it: a late report of an abandoned save finds nothing, even if
the same mm_hash is being saved again under a new grant.

Reports arrive on the scheduler thread (`update_connector_output`) or, on an
encode-only instance, on the report listener's thread the moment the workers
send them, whether the engine steps again or not (see `reports`). A request
that finishes waits for its report only briefly (`await_reports`: the workers
sent it before their step returned, so it is normally applied within
microseconds), and not at all once reports are known to run late: an item
whose copy ran in a step that has completed is announced anyway; a consumer
that asks before the commit lands is told NOT_READY and retries; a copy that
failed after all is not granted, and that consumer encodes the item itself.
While a save planned in the last `STEP_ON_S` awaits its report, an encode-only
engine with no request left steps on (`LateReports.keeps_stepping`), so that the
report's counts reach vLLM without waiting for the next request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ecshare.config import Config
from ecshare.store import Entry, EntryExists, EntryMeta, EntryState, NotFound, Store, StoreFull
from ecshare.vllm.ops import SaveOp, StepReport
from ecshare.vllm.tally import Tally

log = logging.getLogger(__name__)

# How long a finished request waits for its workers' report (`LateReports.await_reports`);
# once one is this late, none waits again until a report arrives.
REPORT_GRACE_S = 0.1
# How long an encode-only engine with no request left steps on for a save's late report
# (`LateReports.keeps_stepping`): each empty step costs it most of a core.
STEP_ON_S = 2.0


@dataclass(frozen=True)
class _Save:
    mm_hash: str
    entry: Entry
    started: float  # monotonic; given up `save_report_timeout_s` later (`abandon_overdue`)


class SaveBook:
    def __init__(self, store: Store, config: Config, tally: Tally) -> None:
        self._store = store
        self._config = config
        self._tally = tally
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._pending: dict[str, _Save] = {}  # grant -> save, oldest first
        self._by_hash: dict[str, str] = {}  # mm_hash -> grant of its save in flight

    def in_flight(self, since: float) -> bool:
        """Whether a save planned at or after `since` (monotonic) awaits its report."""
        with self._lock:
            newest = next(reversed(self._pending.values()), None)
            return newest is not None and newest.started >= since

    def saving(self, mm_hash: str) -> Entry | None:
        """The ALLOCATED entry being filled for `mm_hash`, if a save of it is in flight."""
        with self._lock:
            grant = self._by_hash.get(mm_hash)
            return None if grant is None else self._pending[grant].entry

    def await_reports(self, hashes: list[str], timeout_s: float) -> bool:
        """Wait until no save of `hashes` awaits its report, at most `timeout_s`; whether so."""
        with self._applied:
            return self._applied.wait_for(
                lambda: not any(h in self._by_hash for h in hashes), timeout_s
            )

    def plan(self, mm_hash: str, meta: EntryMeta, nbytes: int) -> SaveOp | None:
        """Reserve an entry for the encoder output of `mm_hash`; None if stored, being
        stored, or there is no room (counted as save_skipped)."""
        with self._lock:
            if mm_hash in self._by_hash or self._store.get(mm_hash) is not None:
                return None
            try:
                entry = self._store.allocate(mm_hash, nbytes, meta)
            except (StoreFull, EntryExists, ValueError) as exc:
                self._tally.add("save_skipped")
                log.warning("ecshare: not saving %s: %s", mm_hash, exc)
                return None
            grant = f"save-{next(self._ids)}"
            self._pending[grant] = _Save(mm_hash, entry, time.monotonic())
            self._by_hash[mm_hash] = grant
        return SaveOp(grant, mm_hash, entry.extents, nbytes)

    def apply(self, report: StepReport) -> None:
        """Commit the saves the workers finished, free the ones that failed.

        A save leaves the books only once its entry is READY, in one step under the
        lock that `saving` and `await_reports` take: a request finishing meanwhile
        (woken by that wait, on another thread) must find the entry either still
        being saved or READY, never in between, or it would answer without
        announcing the item.
        """
        for grant, (dtype, shape) in report.saved.items():
            with self._lock:
                save = self._pending.get(grant)
                if save is None:
                    self._tally.add("stale_reports")
                    continue
                entry = save.entry
                if (dtype, tuple(shape)) == (entry.meta.dtype, tuple(entry.meta.shape)):
                    checksum = (
                        self._store.checksum(entry) if self._config.checksum != "none" else None
                    )
                    # Counted before the commit, which wakes the producer's thread (to tell
                    # direct readers where the entry lies): a step's take of the counts in
                    # that moment would leave them to a next step an idle encoder may not
                    # take for long.
                    self._tally.add_all({"saved_items": 1, "saved_bytes": entry.nbytes})
                    self._store.commit(entry, checksum=checksum)
                    self._forget(grant, save)
                    continue
            if self._pop(grant) is not None:  # refused: freed as a failed save is
                self._free(save, f"worker saved {dtype}{list(shape)}")
        for grant, why in report.save_failed.items():
            save = self._pop(grant)
            if save is None:
                self._tally.add("stale_reports")
                continue
            self._free(save, why)
            self._tally.add("save_failed")

    def abandon_overdue(self, now: float) -> None:
        """Free the entries of copies the workers never reported, a lease after they began.

        A report comes at the end of the step that made the copy; one missing for a whole
        lease is lost (a worker that died, a dropped message), and without this its
        ALLOCATED entry would hold its blocks for good.
        """
        while True:
            with self._lock:
                if not self._pending:
                    return
                grant, save = next(iter(self._pending.items()))
                if save.started + self._config.save_report_timeout_s > now:
                    return  # oldest first: the rest began later
            if self._pop(grant) is not None:
                timeout = self._config.save_report_timeout_s
                self._free(save, f"no worker report within save_report_timeout_s ({timeout:g} s)")
                self._tally.add("save_abandoned")

    def _pop(self, grant: str) -> _Save | None:
        with self._lock:
            save = self._pending.get(grant)
            if save is not None:
                self._forget(grant, save)
            return save

    def _forget(self, grant: str, save: _Save) -> None:
        """The save leaves the books (the caller holds the lock)."""
        del self._pending[grant]
        if self._by_hash.get(save.mm_hash) == grant:
            del self._by_hash[save.mm_hash]
            self._applied.notify_all()

    def _free(self, save: _Save, why: str) -> None:
        log.warning("ecshare: encoder output %s not stored (%s)", save.mm_hash, why)
        if save.entry.state is EntryState.ALLOCATED:
            with contextlib.suppress(NotFound):  # already freed: nothing of ours is left
                self._store.abort(save.entry)


class LateReports:
    """What an encode-only instance does about saves whose reports run late.

    Its reports arrive on the listener's thread, and vLLM takes the connector's
    counts only in a step. A finished request waits at most `REPORT_GRACE_S` for
    its report, and not at all once one was that late, until a report arrives. An
    engine with no request left steps on while a save planned in the last
    `STEP_ON_S` awaits its report, and until a step has taken the counts of the last
    report applied; a report later than that (a worker stuck or gone) leaves its
    counts to the next request's step, since each empty step crosses the engine's
    processes and costs it most of a core. Thread-safe.
    """

    def __init__(self, saves: SaveBook, tally: Tally) -> None:
        self._saves = saves
        self._tally = tally
        # Held while a report is applied and while a step takes the counts: a take
        # never falls inside a report, and one applied after it sets `_untaken` again.
        self._lock = threading.Lock()
        self._late = False
        self._untaken = False  # a report applied whose counts no step has taken yet

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """Apply one report inside this (on the listener's thread)."""
        with self._lock:
            self._late = False
            yield
            self._untaken = True

    def await_reports(self, hashes: list[str]) -> None:
        """A request of `hashes` finished: wait briefly for their reports, unless
        reports are known to run late."""
        if self._late:
            return
        if not self._saves.await_reports(hashes, REPORT_GRACE_S):
            self._late = True
            log.warning(
                "ecshare: no worker report for %s within %g s; finished requests no "
                "longer wait for reports until one arrives",
                hashes,
                REPORT_GRACE_S,
            )

    def keeps_stepping(self) -> bool:
        since = time.monotonic() - STEP_ON_S
        with self._lock:
            return self._untaken or self._saves.in_flight(since)

    def take(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        """The tally's counts and samples, taken by a step."""
        with self._lock:
            self._untaken = False
            return self._tally.take()
