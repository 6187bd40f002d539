"""The end of a chaos run: let the system go quiet, check the invariants, write the report."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import numpy as np

from ecshare.apps.chaos.fleet import _due
from ecshare.apps.chaos.load import Load
from ecshare.apps.chaos.messages import Fetch, NodeStats, Quiesce
from ecshare.apps.chaos.nodes import Child, ChildGone
from ecshare.apps.chaos.options import _STATS_TIMEOUT_S
from ecshare.apps.chaos.report import ChaosReport, RegionCheck
from ecshare.apps.chaos.soak import SoakSampling

# The consumers' counters of direct reads a report sums (`ChaosReport.direct_counters`).
DIRECT_COUNTERS = frozenset(
    {
        "direct_reads",
        "direct_reads_stale",
        "direct_reads_failed",
        "tag_reads",
        "tag_peeks",
        "tag_peeks_failed",
    }
)


class Verdict(Load, SoakSampling):
    def _finish(self, started: float) -> ChaosReport:
        o = self.o
        # Faults end. Armed children answer (and may freeze) within their bound...
        answered_by = time.monotonic() + o.read_wait_s + _STATS_TIMEOUT_S
        while self.armed_children() and time.monotonic() < answered_by:
            self.collect(0.05)
        for c in self.armed_children():
            self.hangs += 1
            self.tally.violations.append(f"{c.name} never answered Arm ({c.armed})")
            c.armed = ""
        # ...and the scheduled repairs (resumes, restarts) still happen, on time.
        for timer in self.resumes:
            timer.join()
        self._repair()
        for proxy in self.proxies:
            proxy.calm()
        frozen_at_end = sum(1 for c in self.producers if c is not None and c.paused)
        # (c) Every fetch still out settles within its bound.
        limit = time.monotonic() + max((p.bound_s for p in self.pending.values()), default=0) + 2.0
        while self.pending and time.monotonic() < limit:
            self.collect(0.05)
        for p in self.pending.values():
            self.tally.violations.append(f"fetch of {p.mm_hash} never settled ({p.consumer.name})")
        hung_fetches = len(self.pending)
        self.pending.clear()
        hung_pushes = self._settle_pushes()
        # A producer that died since (the known UCX abort strikes as a producer
        # resumes) is counted and restarted before the checks, which need every one.
        self._repair()
        # (b) Quiet: churn stops, sessions of dead consumers end, leases run out.
        live = [c for c in [*filter(None, self.producers), *self.consumers] if c.alive()]
        for c in live:
            if c.role == "producer":
                try:
                    c.call(Quiesce(), _STATS_TIMEOUT_S)
                except ChildGone as exc:
                    if not c.exited(1.0):  # a crash is counted as one (reap_crashes)
                        self.hangs += 1
                        self.tally.violations.append(f"no answer to Quiesce: {exc}")
        final = self._quiet(live)
        unrecovered = self._probe_recovery(final)
        # The probe's own grants go back with its consumers' next Releases, which
        # may wait a moment (they ride with the next message): quiet again.
        self._quiet(live)
        regions = []
        for c in live:
            stats = self._stats(c, verify=True)
            if stats is None:
                continue
            regions.append(
                _region_check(f"{c.role}-{c.index}", stats, excuse_quarantine=frozen_at_end > 0)
            )
            if c.role == "consumer" and stats.wrong:
                self.tally.corrupted += len(stats.wrong)
                self.tally.violations.append(f"{c.name}: READY with wrong bytes: {stats.wrong[:5]}")
            if c.role == "producer" and stats.wrong:
                self.tally.violations.append(
                    f"{c.name}: producer entries corrupted: {stats.wrong[:5]}"
                )
        if o.soak_s:
            self.sample(time.monotonic() - self.load_started)
        # (d) Every process exits when told, and none exited by itself before.
        self.reap_crashes(replace=False)
        for c in [*live, *self.retired]:
            if not c.stop(self.config.shutdown_timeout_s + 10.0):
                self.hangs += 1
                self.tally.violations.append(f"{c.name} did not exit when told to stop")
        self.producers = [None] * o.producers
        self.consumers = []
        self.retired = []
        return self._report(started, regions, hung_fetches, unrecovered, frozen_at_end, hung_pushes)

    def _repair(self) -> None:
        """Children that died by themselves are counted and replaced, and every restart
        scheduled happens, on time."""
        self.reap_crashes()
        while self.scheduled:
            item = min(self.scheduled, key=_due)
            self.collect(max(0.0, item[0] - time.monotonic()))
            if item[0] <= time.monotonic():
                self.scheduled.remove(item)
                item[2]()

    def _settle_pushes(self) -> int:
        """Every push ends once its write has: the producer's data plane says so, and
        every process runs again now. Returns the pushes of live producers that never
        ended."""
        cfg = self.config
        limit = time.monotonic() + 2 * cfg.grant_lease_s + cfg.request_timeout_s + self.o.grace_s
        while time.monotonic() < limit:
            for producer in {p.producer for p in self.pending_pushes.values()}:
                if not producer.alive():
                    self._lose_pushes(producer)
            if not self.pending_pushes:
                return 0
            self.collect(0.05)
        for p in self.pending_pushes.values():
            self.tally.violations.append(
                f"push {p.push_id} of {p.mm_hash} to {p.to} never ended ({p.producer.name})"
            )
        hung = len(self.pending_pushes)
        self.pending_pushes.clear()
        return hung

    def _quiet(self, live: list[Child]) -> dict[str, NodeStats]:
        """Every live node's stats once nothing is pinned, written or quarantined any more
        (or once leases and heartbeats would have ended it all, whichever comes first)."""
        cfg = self.config
        quiet_by = time.monotonic() + cfg.grant_lease_s + cfg.heartbeat_timeout_s + 5.0
        while True:
            final = {}
            for c in live:
                stats = self._stats(c)
                if stats is not None:
                    final[c.name] = stats
            busy = [
                n
                for n, s in final.items()
                if s.store.pins or s.store.allocated or s.store.quarantined
            ]
            if not busy or time.monotonic() >= quiet_by:
                return final
            time.sleep(0.2)

    def _probe_recovery(self, final: dict[str, NodeStats]) -> int:
        """(e) Once the faults end, every consumer fetches from every producer again.

        Restarted producers serve under the same key and port, and consumers find
        them again after quarantine. Returns the (consumer, producer) pairs that
        did not recover within a bound.
        """
        pairs = []
        for i, producer in enumerate(self.producers):
            stats = final.get(producer.name) if producer is not None else None
            if stats is None or not stats.ready_keys:
                continue
            for consumer in self.consumers:
                pairs.append((consumer, i, stats.ready_keys[: self.o.batch_max]))
        failed = 0
        for consumer, i, keys in pairs:
            deadline = time.monotonic() + self.config.quarantine_s + 10.0
            while True:
                ids = []
                for _ in keys:
                    self._fetch_ids += 1
                    ids.append(self._fetch_ids)
                    self.probes[self._fetch_ids] = None
                items = [(fid, h, n) for fid, (h, n) in zip(ids, keys, strict=True)]
                with contextlib.suppress(ChildGone):
                    consumer.send(Fetch(items, [self.proxies[i].address]))
                settle_by = time.monotonic() + self.config.fetch_deadline_max_s + self.o.grace_s
                while time.monotonic() < settle_by and any(self.probes[f] is None for f in ids):
                    self.collect(0.05)
                outcomes = [self.probes.pop(f) for f in ids]
                if all(o is not None and o.status == "delivered" for o in outcomes):
                    break
                if any(o is not None and o.status == "corrupted" for o in outcomes):
                    self.tally.corrupted += 1
                    self.tally.violations.append(f"{consumer.name}: corrupted probe from {i}")
                if time.monotonic() >= deadline:
                    failed += 1
                    why = [o.reason if o else "no outcome" for o in outcomes]
                    self.tally.violations.append(
                        f"{consumer.name} cannot fetch from producer {i} after the faults: {why}"
                    )
                    break
                time.sleep(0.5)
        self.recovery_pairs = len(pairs) - failed
        return failed

    def _report(
        self,
        started: float,
        regions: list[RegionCheck],
        hung_fetches: int,
        unrecovered: int,
        frozen_at_end: int,
        hung_pushes: int = 0,
    ) -> ChaosReport:
        t = self.tally
        push_counters: Counter[str] = Counter()
        for side, seen in (
            ("consumer", self.consumer_counters),
            ("producer", self.producer_counters),
        ):
            for counters in seen.values():
                push_counters.update(
                    {f"{side}.{k}": v for k, v in counters.items() if k.startswith("push")}
                )
        direct_counters: Counter[str] = Counter()
        for counters in self.consumer_counters.values():
            direct_counters.update({k: v for k, v in counters.items() if k in DIRECT_COUNTERS})
        faults = {k: self.faults[k] for k in self.o.faults}
        faults["control_delayed_chunks"] = sum(p.counters["delayed_chunks"] for p in self.proxies)
        faults["control_random_cuts"] = sum(p.counters["random_cuts"] for p in self.proxies)
        faults["evictions_under_load"] = sum(
            last - first for first, last in self.evictions.values()
        )
        faults["restarts_same_key_and_port"] = self.faults["restarts_same_key_and_port"]
        # Requests for entries evicted meanwhile, as the producers answered them.
        faults["missing_refusals"] = sum(
            c.get("refused_missing", 0) for c in self.producer_counters.values()
        )
        faults["control_connections"] = sum(p.counters["connections"] for p in self.proxies)
        faults["control_held_chunks"] = sum(p.counters["held_chunks"] for p in self.proxies)
        for extra in (
            "mid_read_misses",
            "mid_push_misses",
            "reads_done_under_partition",
            "lease_restored",
            "push_deadline_restored",
        ):
            faults[extra] = self.faults[extra]
        faults["shrunk_at_end"] = len(self.shrunk)
        leaked_blocks = sum(r.leaked_blocks for r in regions)
        leaked_pins = sum(r.pins for r in regions)
        writes_after_free = sum(self.canary_violations.values())
        if writes_after_free:
            t.violations.append(
                f"{writes_after_free} writes after free: freed blocks found written when handed "
                "out again (store canary)"
            )
        for r in regions:
            if r.leaked_blocks or r.pins or r.allocated or r.evicting:
                t.violations.append(
                    f"region {r.node}: {r.leaked_blocks} leaked blocks, {r.pins} pins, "
                    f"{r.allocated} half-written, {r.evicting} evicting entries, "
                    f"{r.quarantined_blocks} blocks quarantined"
                )
            if r.invariant_error:
                t.violations.append(f"region {r.node}: {r.invariant_error}")
        settle = np.array(t.settle_s or [0.0]) * 1000
        soak = self._soak(t) if self.o.soak_s else None
        duration = time.monotonic() - started
        return ChaosReport(
            seed=self.seed,
            duration_s=round(duration, 2),
            producers=self.o.producers,
            consumers=self.o.consumers,
            fetches_attempted=t.attempted,
            delivered=t.delivered,
            failed=dict(t.failed),
            lost_with_consumer=t.lost_with_consumer,
            faults=faults,
            corrupted=t.corrupted,
            untyped_failures=t.untyped,
            vanished=t.vanished,
            late=t.late,
            max_overrun_s=round(t.max_overrun_s, 3) if t.settle_s else 0.0,
            hung_fetches=hung_fetches,
            hangs=self.hangs,
            recovered_pairs=self.recovery_pairs,
            unrecovered_pairs=unrecovered,
            leaked_blocks=leaked_blocks,
            leaked_pins=leaked_pins,
            writes_after_free=writes_after_free,
            settle_p50_ms=round(float(np.percentile(settle, 50)), 2),
            settle_p99_ms=round(float(np.percentile(settle, 99)), 2),
            settle_max_ms=round(float(settle.max()), 2),
            regions=regions,
            violations=t.violations[:50],
            ok=not t.violations and not self.hangs and not self.crashes and not hung_pushes,
            netem=self.o.netem,
            soak=soak,
            transport=self.o.ucx_tls,
            network="netns" if self.hosts is not None else "loopback",
            veth_bytes=sum(self.hosts.bytes_sent(h) for h in self.producer_hosts)
            if self.hosts is not None
            else 0,
            frozen_at_end=frozen_at_end,
            crashes=self.crashes,
            known_ucx_aborts=list(self.known_ucx_aborts),
            fault_log=self.fault_log,
            delivered_bytes=t.delivered_bytes,
            push=self.o.push,
            pushes_attempted=self.pushes.attempted,
            push_outcomes=dict(self.pushes.ended),
            pushes_lost_with_producer=self.pushes.lost_with_producer,
            hung_pushes=hung_pushes,
            delivered_pushed=self.pushes.delivered_pushed,
            push_settle_max_ms=round(self.pushes.max_settle_s * 1000, 2),
            push_counters=dict(sorted(push_counters.items())),
            direct_counters=dict(sorted(direct_counters.items())),
        )


def _region_check(node: str, stats: NodeStats, *, excuse_quarantine: bool = False) -> RegionCheck:
    """One region once the run is quiet. Quarantined blocks (a read may still write
    them) are leaked unless `excuse_quarantine`: a producer still frozen can keep a
    read in flight for good, and then holding its destination is the promise kept."""
    s = stats.store
    unaccounted = s.total_blocks - s.free_blocks - s.used_blocks
    excused = s.quarantined_blocks if excuse_quarantine else 0
    # A consumer's standing push credit (one per push session) is held by design.
    excused += s.reserved_blocks
    return RegionCheck(
        node=node,
        total_blocks=s.total_blocks,
        free_blocks=s.free_blocks,
        used_blocks=s.used_blocks,
        ready_blocks=stats.used_by_ready,
        pins=s.pins,
        allocated=s.allocated - s.reserved,
        evicting=s.evicting,
        verified_entries=stats.verified,
        leaked_blocks=(s.used_blocks - stats.used_by_ready - excused) + abs(unaccounted),
        invariant_error=stats.invariant_error,
        quarantined=s.quarantined,
        quarantined_blocks=s.quarantined_blocks,
        canary_violations=s.canary_violations,
    )
