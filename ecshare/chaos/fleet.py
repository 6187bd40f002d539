"""The harness's processes: starting and restarting them, and the faults injected into them.

Producers are killed (and restarted under the same key and port), paused for
longer than a lease and restarted cleanly; consumers are killed and replaced;
control connections are cut and delayed through their `FaultProxy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ecshare.chaos.messages import ConsumerSpec, NodeStats, Outcome, ProducerSpec
from ecshare.chaos.nodes import Child, ChildGone, consumer_main, producer_main
from ecshare.chaos.options import _START_TIMEOUT_S, _STATS_TIMEOUT_S, FINGERPRINT
from ecshare.chaos.state import RunState


class Fleet(RunState):
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

    def _running_producers(self) -> list[int]:
        """Live producers that are not paused: the ones a fault may take."""
        return [
            i for i, c in enumerate(self.producers) if c is not None and c.alive() and not c.paused
        ]

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
        live = self._running_producers()
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
        live = self._running_producers()
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
        live = self._running_producers()
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


def _due(item: tuple[float, str, Callable[[], None]]) -> float:
    return item[0]
