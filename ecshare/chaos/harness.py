"""`ecshare chaos`: fetches between real processes under randomized faults, then the invariants.

Producers and consumers run as separate processes on 127.0.0.1 (real
Producer/Consumer, CURVE, NIXL). Every consumer reaches every producer through
its own `FaultProxy`, so control messages can be delayed and lost. While the
consumers fetch, the harness SIGKILLs producers (restarted under the same key
and port) and consumers (replaced), pauses producers with SIGSTOP for longer
than a lease, restarts producers cleanly, cuts and delays control connections,
and keeps every producer's region smaller than its working set.

Once the fetches are done it lets the system go quiet and checks:

(a) no entry became READY in a consumer with wrong bytes;
(b) every surviving region has no pins, nothing half-written, and free + used
    = total, with every used block held by a READY entry;
(c) every fetch delivered the right bytes or ended with a typed `FetchFailed`,
    within its deadline plus a grace;
(d) no process hung: each answered within its bound and exited when told.

`--soak SECONDS` runs the same machinery without faults for a fixed time and
samples every process's RSS and every region's usage (see `Soak`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ecshare.chaos.faultproxy import FaultProxy, Faults
from ecshare.chaos.messages import (
    ConsumerSpec,
    Fetch,
    NodeStats,
    Outcome,
    ProducerSpec,
    Quiesce,
)
from ecshare.chaos.nodes import Child, ChildGone, consumer_main, producer_main, working_set_keys
from ecshare.chaos.report import (
    ChaosReport,
    ProcessMemory,
    RegionCheck,
    RegionUsage,
    Soak,
)
from ecshare.config import Config
from ecshare.control import generate_keypair

MiB = 1 << 20
FINGERPRINT = "ecshare-chaos"
FAULT_KINDS = (
    "kill_producer",
    "kill_consumer",
    "pause_producer",
    "restart_producer",
    "cut_control",
    "delay_control",
)
# Short timeouts, so that every fault resolves within seconds; the consumer's
# deadline cap stays under the lease, as the config requires.
TIMING: dict[str, Any] = {
    "prefault": False,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "handshake_timeout_s": 1.0,
    "request_timeout_s": 1.0,
    "lease_s": 3.0,
    "fetch_deadline_base_s": 2.0,
    "fetch_deadline_max_s": 2.5,
    "retry_initial_backoff_s": 0.01,
    "retry_max_backoff_s": 0.1,
    "quarantine_s": 0.5,
    "reap_interval_s": 0.1,
    "shutdown_timeout_s": 2.0,
    "ucx_net_devices": "lo",
}
_START_TIMEOUT_S = 60.0
_STATS_TIMEOUT_S = 10.0


@dataclass
class ChaosOptions:
    fetches: int = 2000
    soak_s: float = 0.0  # > 0: a soak of this many seconds instead of `fetches`
    producers: int = 2
    consumers: int = 3
    seed: int | None = None
    faults: tuple[str, ...] = FAULT_KINDS
    fault_interval_s: float = 1.5  # mean time between injected faults
    working_set: str = "64KiB:96,1MiB:24"  # 30 MiB per producer
    producer_region_bytes: int = 16 * MiB  # smaller than the working set: eviction pressure
    consumer_region_bytes: int = 64 * MiB
    churn_per_s: float = 20.0
    batch_max: int = 4
    inflight_per_consumer: int = 8
    grace_s: float = 2.0
    control_delay_prob: float = 0.02
    control_max_delay_s: float = 0.3
    control_cut_prob: float = 0.0005
    sample_interval_s: float = 1.0
    warmup_fraction: float = 0.3
    netem: str = ""  # set by the netns wrapper: recorded in the report
    every_fault_within_s: float = 300.0  # run on past `fetches` until every kind has run
    verbose: bool = False  # children log warnings (peer failures are expected here)


@dataclass
class _Pending:
    fetch_id: int
    mm_hash: str
    nbytes: int
    consumer: Child
    bound_s: float  # deadline + grace


@dataclass
class _Tally:
    attempted: int = 0
    delivered: int = 0
    delivered_bytes: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    corrupted: int = 0
    untyped: int = 0
    vanished: int = 0
    late: int = 0
    max_overrun_s: float = -1e9
    lost_with_consumer: int = 0
    # 8 bytes a fetch: a soak records some 100 000 fetches a minute.
    settle_s: array[float] = field(default_factory=lambda: array("d"))
    violations: list[str] = field(default_factory=list)


class ChaosRun:
    def __init__(self, options: ChaosOptions, workdir: Path) -> None:
        # Imported here, before anything starts, and not with the module: the rest of
        # the command line must work without the chaos extra.
        import psutil

        self._psutil = psutil
        self.o = options
        self.seed = (
            options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
        )
        self.rng = random.Random(self.seed)
        self.keys = working_set_keys(options.working_set)
        producer_keys = generate_keypair(workdir, "producer")
        consumer_keys = generate_keypair(workdir, "consumer")
        self.producer_config = {
            **TIMING,
            "region_bytes": options.producer_region_bytes,
            "server_secret_key_file": str(producer_keys.secret_path),
            "authorized_keys_file": str(consumer_keys.public_path),
        }
        self.consumer_config = {
            **TIMING,
            "region_bytes": options.consumer_region_bytes,
            "client_secret_key_file": str(consumer_keys.secret_path),
            "server_public_key_file": str(producer_keys.public_path),
        }
        self.config = Config.from_dict(self.consumer_config)
        self.outcomes: queue.Queue[Outcome] = queue.Queue()
        self.pending: dict[int, _Pending] = {}
        self.tally = _Tally()
        self.faults: Counter[str] = Counter()
        self.hangs = 0
        self.producers: list[Child | None] = [None] * options.producers
        self.ports: list[int] = [0] * options.producers
        self.proxies: list[FaultProxy] = []
        self.consumers: list[Child] = []
        self.retired: list[Child] = []  # replaced children, reaped at the end
        self.scheduled: list[tuple[float, str, Callable[[], None]]] = []
        self.evictions: dict[int, tuple[int, int]] = {}  # producer pid -> (first, last) seen
        self._fetch_ids = 0
        self._deck: list[str] = []
        self.budget = options.fetches  # grows while some fault kind has not run yet
        self.probes: dict[int, Outcome | None] = {}  # fetch id -> outcome, after the faults
        self.recovery_pairs = 0
        self.load_started = 0.0
        self.producer_counters: dict[int, dict[str, int]] = {}  # pid -> last seen
        self._consumer_ids = 0
        self._seed_ids = 0
        self.rss: dict[str, list[tuple[float, float, float]]] = {}  # name -> (t, rss, anon)
        self.usage: dict[str, list[tuple[float, float]]] = {}

    # -- processes ---------------------------------------------------------------------------

    def _on_outcome(self, child: Child, outcome: Outcome) -> None:
        self.outcomes.put(outcome)  # from a reader thread; the main loop owns the tally

    def start_producer(self, index: int, port: int = 0) -> Child:
        self._seed_ids += 1
        spec = ProducerSpec(
            config={**self.producer_config, "listen_port": port},
            fingerprint=FINGERPRINT,
            working_set=self.o.working_set,
            churn_per_s=self.o.churn_per_s,
            seed=self.seed * 1000 + self._seed_ids,
        )
        child = Child(
            "producer",
            index,
            producer_main,
            spec,
            self._on_outcome,
            start_timeout_s=_START_TIMEOUT_S,
            verbose=self.o.verbose,
        )
        self.producers[index] = child
        self.ports[index] = child.ready.port
        stats = self._stats(child)
        if stats is not None:
            self.evictions[child.pid] = (stats.store.evictions, stats.store.evictions)
        return child

    def start_consumer(self) -> Child:
        self._consumer_ids += 1
        spec = ConsumerSpec(config=self.consumer_config, fingerprint=FINGERPRINT)
        child = Child(
            "consumer",
            self._consumer_ids,
            consumer_main,
            spec,
            self._on_outcome,
            start_timeout_s=_START_TIMEOUT_S,
            verbose=self.o.verbose,
        )
        self.consumers.append(child)
        return child

    def _stats(self, child: Child, *, verify: bool = False) -> NodeStats | None:
        try:
            stats = child.stats(_STATS_TIMEOUT_S, verify=verify)
        except ChildGone as exc:
            if child.alive() and not child.paused:
                self.hangs += 1
                self.tally.violations.append(f"no stats: {exc}")
            return None
        if child.role == "producer":
            self.producer_counters[child.pid] = stats.counters
        if child.role == "producer" and child.pid in self.evictions:
            first, _ = self.evictions[child.pid]
            self.evictions[child.pid] = (first, stats.store.evictions)
        return stats

    # -- faults ------------------------------------------------------------------------------

    def _later(self, delay_s: float, label: str, action: Callable[[], None]) -> None:
        self.scheduled.append((time.monotonic() + delay_s, label, action))

    def _live_producers(self) -> list[int]:
        return [i for i, c in enumerate(self.producers) if c is not None and c.alive()]

    def _restart_producer(self, index: int, attempt: int = 0) -> None:
        try:
            self.start_producer(index, self.ports[index])
            self.faults["restarts_same_key_and_port"] += 1
        except ChildGone as exc:
            # The port may still be held for a moment by the dead incarnation.
            if attempt >= 10:
                self.tally.violations.append(f"producer {index} did not restart: {exc}")
                return
            self._later(0.5, "restart", lambda: self._restart_producer(index, attempt + 1))

    def inject(self) -> None:
        # Dealt from a shuffled deck, so every kind comes up once per round; a kind
        # that cannot apply now (no busy consumer, say) waits in the deck.
        if not self._deck:
            self._deck = list(self.o.faults)
            self.rng.shuffle(self._deck)
        for kind in list(self._deck):
            if getattr(self, f"_fault_{kind}")():
                self._deck.remove(kind)
                self.faults[kind] += 1
                return

    def _fault_kill_producer(self) -> bool:
        live = [i for i in self._live_producers() if not self.producers[i].paused]  # type: ignore[union-attr]
        if not live:
            return False
        index = self.rng.choice(live)
        child = self.producers[index]
        assert child is not None
        child.kill()
        self.retired.append(child)
        self.producers[index] = None
        self._later(self.rng.uniform(0.2, 1.5), "restart", lambda: self._restart_producer(index))
        return True

    def _fault_restart_producer(self) -> bool:
        """A clean stop and a start under the same key and port."""
        live = [i for i in self._live_producers() if not self.producers[i].paused]  # type: ignore[union-attr]
        if not live:
            return False
        index = self.rng.choice(live)
        child = self.producers[index]
        assert child is not None
        self.producers[index] = None
        if not child.stop(self.config.shutdown_timeout_s + 5.0):
            self.hangs += 1
            self.tally.violations.append(f"{child.name} did not exit when told to stop")
        self.retired.append(child)
        self._restart_producer(index)
        return True

    def _fault_pause_producer(self) -> bool:
        live = [i for i in self._live_producers() if not self.producers[i].paused]  # type: ignore[union-attr]
        if not live:
            return False
        child = self.producers[self.rng.choice(live)]
        assert child is not None
        child.pause()
        # Longer than a lease: grants it made may expire while it sleeps.
        pause_s = self.config.lease_s * self.rng.uniform(1.1, 1.6)
        self._later(pause_s, "resume", child.resume)
        return True

    def _fault_kill_consumer(self) -> bool:
        busy = [c for c in self.consumers if any(p.consumer is c for p in self.pending.values())]
        if not busy:
            return False
        victim = self.rng.choice(busy)
        victim.kill()
        self.consumers.remove(victim)
        self.retired.append(victim)
        lost = [k for k, p in self.pending.items() if p.consumer is victim]
        for k in lost:
            del self.pending[k]
        self.tally.lost_with_consumer += len(lost)
        self.start_consumer()
        return True

    def _fault_cut_control(self) -> bool:
        self.rng.choice(self.proxies).cut_all()
        return True

    def _fault_delay_control(self) -> bool:
        # Up to 1.5x the request timeout: some replies arrive after the consumer
        # gave up on them, and their grants must still come back.
        self.rng.choice(self.proxies).delay_burst(
            self.rng.uniform(0.5, 2.0), self.config.request_timeout_s * 1.5
        )
        return True

    # -- load --------------------------------------------------------------------------------

    def feed(self) -> None:
        for consumer in list(self.consumers):
            mine = [p for p in self.pending.values() if p.consumer is consumer]
            room = self.o.inflight_per_consumer - len(mine)
            if room <= 0 or (not self.o.soak_s and self.tally.attempted >= self.budget):
                continue
            busy = {p.mm_hash for p in mine}
            n = min(room, self.rng.randint(1, self.o.batch_max))
            if not self.o.soak_s:
                n = min(n, self.budget - self.tally.attempted)
            picks = [
                k
                for k in self.rng.sample(self.keys, min(len(self.keys), n * 3))
                if k[0] not in busy
            ]
            picks = picks[:n]
            if not picks:
                continue
            peers = [p.address for p in self.proxies]
            self.rng.shuffle(peers)
            items = []
            for h, nbytes in picks:
                self._fetch_ids += 1
                items.append((self._fetch_ids, h, nbytes))
                self.pending[self._fetch_ids] = _Pending(
                    self._fetch_ids,
                    h,
                    nbytes,
                    consumer,
                    self.config.fetch_deadline_s(nbytes) + self.o.grace_s,
                )
            try:
                consumer.send(Fetch(items, peers))
            except ChildGone as exc:
                self.tally.violations.append(f"consumer died by itself: {exc}")
                for fetch_id, _, _ in items:
                    self.pending.pop(fetch_id, None)
                continue
            self.tally.attempted += len(items)

    def collect(self, timeout_s: float) -> None:
        try:
            outcome = self.outcomes.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            self._record(outcome)
            try:
                outcome = self.outcomes.get_nowait()
            except queue.Empty:
                return

    def _record(self, outcome: Outcome) -> None:
        if outcome.fetch_id in self.probes:
            self.probes[outcome.fetch_id] = outcome
            return
        pending = self.pending.pop(outcome.fetch_id, None)
        if pending is None:
            return  # from a consumer that was killed meanwhile: already counted as lost
        t = self.tally
        t.settle_s.append(outcome.settle_s)
        overrun = outcome.settle_s - (pending.bound_s - self.o.grace_s)
        t.max_overrun_s = max(t.max_overrun_s, overrun)
        if outcome.settle_s > pending.bound_s:
            t.late += 1
            t.violations.append(
                f"{outcome.mm_hash} settled {outcome.status} after {outcome.settle_s:.2f} s, "
                f"bound {pending.bound_s:.2f} s"
            )
        if outcome.status == "delivered":
            t.delivered += 1
            t.delivered_bytes += pending.nbytes
        elif outcome.status == "failed":
            t.failed[outcome.reason] += 1
        elif outcome.status == "corrupted":
            t.corrupted += 1
            t.violations.append(f"{outcome.mm_hash} READY with wrong bytes (from {outcome.detail})")
        elif outcome.status == "untyped":
            t.untyped += 1
            t.violations.append(
                f"{outcome.mm_hash} ended untyped: {outcome.reason} {outcome.detail}"
            )
        else:
            t.vanished += 1
            t.violations.append(f"{outcome.mm_hash} vanished before it could be checked")

    # -- soak sampling ---------------------------------------------------------------------

    def sample(self, t: float) -> None:
        named = {"harness": os.getpid()}
        for c in [*self.consumers, *filter(None, self.producers)]:
            if c.alive():
                named[f"{c.role}-{c.index}"] = c.pid
        for name, pid in named.items():
            with contextlib.suppress(self._psutil.Error):
                mem = self._psutil.Process(pid).memory_info()
                self.rss.setdefault(name, []).append(
                    (t, mem.rss / MiB, (mem.rss - mem.shared) / MiB)
                )
        for c in [*filter(None, self.producers), *self.consumers]:
            if c.alive() and not c.paused:
                stats = self._stats(c)
                if stats is not None:
                    s = stats.store
                    self.usage.setdefault(f"{c.role}-{c.index}", []).append(
                        (t, s.used_blocks / s.total_blocks)
                    )

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> ChaosReport:
        o = self.o
        started = time.monotonic()
        try:
            for i in range(o.producers):
                self.start_producer(i)
            for i in range(o.producers):
                self.proxies.append(
                    FaultProxy(
                        "127.0.0.1",
                        self.ports[i],
                        faults=Faults(
                            o.control_delay_prob, o.control_max_delay_s, o.control_cut_prob
                        ),
                        seed=self.seed + i,
                    )
                )
            for _ in range(o.consumers):
                self.start_consumer()
            # The clock of the load (soak length, samples) starts once every process is up.
            self.load_started = time.monotonic()
            self._drive(self.load_started)
            return self._finish(started)
        finally:
            self._teardown()

    def _drive(self, started: float) -> None:
        o = self.o
        next_fault = started + self.rng.expovariate(1 / o.fault_interval_s)
        next_poll = started
        while True:
            now = time.monotonic()
            if o.soak_s and now - started >= o.soak_s:
                break
            if not o.soak_s and self.tally.attempted >= self.budget:
                missing = [k for k in o.faults if not self.faults[k]]
                if not missing or now - started > o.every_fault_within_s:
                    for kind in missing:
                        self.tally.violations.append(f"fault kind {kind} never injected")
                    break
                # Every kind runs at least once: more load, and the next fault now.
                self.budget += o.inflight_per_consumer
                next_fault = min(next_fault, now + 0.2)
            for item in sorted((s for s in self.scheduled if s[0] <= now), key=_due):
                self.scheduled.remove(item)
                item[2]()
            if o.faults and now >= next_fault:
                self.inject()
                next_fault = now + self.rng.expovariate(1 / o.fault_interval_s)
            if now >= next_poll:
                # Sampling doubles as a liveness check of every running child.
                self.sample(now - started)
                next_poll = now + o.sample_interval_s
            self.feed()
            self.collect(0.005)

    def _finish(self, started: float) -> ChaosReport:
        o = self.o
        # Faults end; the scheduled repairs (resumes, restarts) still happen, on time.
        while self.scheduled:
            item = min(self.scheduled, key=_due)
            self.collect(max(0.0, item[0] - time.monotonic()))
            if item[0] <= time.monotonic():
                self.scheduled.remove(item)
                item[2]()
        for proxy in self.proxies:
            proxy.calm()
        # (c) Every fetch still out settles within its bound.
        limit = time.monotonic() + max((p.bound_s for p in self.pending.values()), default=0) + 2.0
        while self.pending and time.monotonic() < limit:
            self.collect(0.05)
        for p in self.pending.values():
            self.tally.violations.append(f"fetch of {p.mm_hash} never settled ({p.consumer.name})")
        hung_fetches = len(self.pending)
        self.pending.clear()
        # (b) Quiet: churn stops, sessions of dead consumers end, leases run out.
        live = [c for c in [*filter(None, self.producers), *self.consumers] if c.alive()]
        for c in live:
            if c.role == "producer":
                try:
                    c.call(Quiesce(), _STATS_TIMEOUT_S)
                except ChildGone as exc:
                    self.hangs += 1
                    self.tally.violations.append(f"no answer to Quiesce: {exc}")
        cfg = self.config
        quiet_by = time.monotonic() + cfg.lease_s + cfg.heartbeat_timeout_s + 5.0
        final: dict[str, NodeStats] = {}
        while True:
            final = {}
            for c in live:
                stats = self._stats(c)
                if stats is not None:
                    final[c.name] = stats
            busy = [n for n, s in final.items() if s.store.pins or s.store.allocated]
            if not busy or time.monotonic() >= quiet_by:
                break
            time.sleep(0.2)
        unrecovered = self._probe_recovery(final)
        regions = []
        for c in live:
            stats = self._stats(c, verify=True)
            if stats is None:
                continue
            regions.append(_region_check(f"{c.role}-{c.index}", stats))
            if c.role == "consumer" and stats.wrong:
                self.tally.corrupted += len(stats.wrong)
                self.tally.violations.append(f"{c.name}: READY with wrong bytes: {stats.wrong[:5]}")
            if c.role == "producer" and stats.wrong:
                self.tally.violations.append(
                    f"{c.name}: producer entries corrupted: {stats.wrong[:5]}"
                )
        if o.soak_s:
            self.sample(time.monotonic() - self.load_started)
        # (d) Every process exits when told.
        for c in [*live, *self.retired]:
            if not c.stop(cfg.shutdown_timeout_s + 10.0):
                self.hangs += 1
                self.tally.violations.append(f"{c.name} did not exit when told to stop")
        self.producers = [None] * o.producers
        self.consumers = []
        self.retired = []
        return self._report(started, regions, hung_fetches, unrecovered)

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
        self, started: float, regions: list[RegionCheck], hung_fetches: int, unrecovered: int
    ) -> ChaosReport:
        t = self.tally
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
        leaked_blocks = sum(r.leaked_blocks for r in regions)
        leaked_pins = sum(r.pins for r in regions)
        for r in regions:
            if r.leaked_blocks or r.pins or r.allocated or r.evicting:
                t.violations.append(
                    f"region {r.node}: {r.leaked_blocks} leaked blocks, {r.pins} pins, "
                    f"{r.allocated} half-written, {r.evicting} evicting entries"
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
            settle_p50_ms=round(float(np.percentile(settle, 50)), 2),
            settle_p99_ms=round(float(np.percentile(settle, 99)), 2),
            settle_max_ms=round(float(settle.max()), 2),
            regions=regions,
            violations=t.violations[:50],
            ok=not t.violations and not self.hangs,
            netem=self.o.netem,
            soak=soak,
        )

    def _soak(self, t: _Tally) -> Soak:
        warmup_s = self.o.soak_s * self.o.warmup_fraction
        memory = []
        for name, series in sorted(self.rss.items()):
            ts = np.array([s[0] for s in series])
            rss = np.array([s[1] for s in series])
            anon = np.array([s[2] for s in series])
            warm = ts >= warmup_s
            if warm.sum() < 2:
                warm = np.ones_like(ts, dtype=bool)
            warm_i = int(np.argmax(warm))
            memory.append(
                ProcessMemory(
                    process=name,
                    samples=len(series),
                    start_mib=round(float(rss[0]), 1),
                    warm_mib=round(float(rss[warm_i]), 1),
                    end_mib=round(float(rss[-1]), 1),
                    max_mib=round(float(rss.max()), 1),
                    slope_mib_per_min=round(_slope(ts[warm], rss[warm]) * 60, 3),
                    anon_warm_mib=round(float(anon[warm_i]), 1),
                    anon_end_mib=round(float(anon[-1]), 1),
                    anon_slope_mib_per_min=round(_slope(ts[warm], anon[warm]) * 60, 3),
                )
            )
        regions = []
        for name, usage in sorted(self.usage.items()):
            fractions = np.array([u[1] for u in usage])
            regions.append(
                RegionUsage(
                    node=name,
                    samples=len(usage),
                    mean_used_fraction=round(float(fractions.mean()), 3),
                    max_used_fraction=round(float(fractions.max()), 3),
                    end_used_fraction=round(float(fractions[-1]), 3),
                    end_pins=0,
                )
            )
        return Soak(
            seconds=self.o.soak_s,
            warmup_s=warmup_s,
            sample_interval_s=self.o.sample_interval_s,
            fetch_rate_per_s=round(t.attempted / self.o.soak_s, 1),
            delivered_mib=round(t.delivered_bytes / MiB, 1),
            memory=memory,
            regions=regions,
        )

    def _teardown(self) -> None:
        # Whatever went wrong, nothing is left running.
        for c in [*filter(None, self.producers), *self.consumers, *self.retired]:
            if c.process.is_alive():
                c.kill()
        for proxy in self.proxies:
            proxy.close()


def _due(item: tuple[float, str, Callable[[], None]]) -> float:
    return item[0]


def _slope(ts: np.ndarray, ys: np.ndarray) -> float:
    if len(ts) < 2 or float(np.ptp(ts)) == 0.0:
        return 0.0
    return float(np.polyfit(ts, ys, 1)[0])


def _region_check(node: str, stats: NodeStats) -> RegionCheck:
    s = stats.store
    unaccounted = s.total_blocks - s.free_blocks - s.used_blocks
    return RegionCheck(
        node=node,
        total_blocks=s.total_blocks,
        free_blocks=s.free_blocks,
        used_blocks=s.used_blocks,
        ready_blocks=stats.used_by_ready,
        pins=s.pins,
        allocated=s.allocated,
        evicting=s.evicting,
        verified_entries=stats.verified,
        leaked_blocks=(s.used_blocks - stats.used_by_ready) + abs(unaccounted),
        invariant_error=stats.invariant_error,
    )


def run_chaos(options: ChaosOptions) -> ChaosReport:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="ecshare-chaos-") as tmp:
        return ChaosRun(options, Path(tmp)).run()
