"""The harness's processes: starting, restarting, stopping and counting them.

`Processes` keeps the producer and consumer children (`ecshare.apps.chaos.nodes`)
and their books: a child that exits by itself is a crash, and the fetches and
pushes it owed are lost with it. A producer dead of the known UCX abort
(`ecshare.apps.chaos.crashes`) is not a crash: it is counted apart and
restarted, as its supervisor would. It also arms a child for a fault that
waits for a read or push in flight (`Arm`); which faults there are, and what
they do when they strike, is `Fleet`'s and `PushFaults`' business.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

from ecshare.apps.chaos.crashes import ConsumerEnd, StderrTap, Stop, ucx_abort_evidence
from ecshare.apps.chaos.hosts import DEVICE
from ecshare.apps.chaos.messages import (
    Arm,
    ConsumerSpec,
    NodeStats,
    Outcome,
    ProducerSpec,
    PushEnded,
    ReadInFlight,
)
from ecshare.apps.chaos.nodes import Child, ChildGone, consumer_main, producer_main
from ecshare.apps.chaos.options import (
    _START_TIMEOUT_S,
    _STATS_TIMEOUT_S,
    FINGERPRINT,
    MID_PUSH_KINDS,
    SHRUNK_LEASE,
    SHRUNK_PUSH_DEADLINE_S,
)
from ecshare.apps.chaos.state import RunState


class Processes(RunState):
    def collect(self, timeout_s: float) -> None:
        """Act on what children said unasked (`Load` does)."""
        raise NotImplementedError

    # -- processes --------------------------------------------------------------------------

    def _on_event(self, child: Child, event: Outcome | PushEnded | ReadInFlight) -> None:
        # From the child's reader thread; the main loop does the rest.
        self.events.put((child, event))

    def producer_config_of(self, index: int) -> dict[str, object]:
        config = {**self.producer_config, **(SHRUNK_LEASE if index in self.shrunk else {})}
        # Every producer sits behind a FaultProxy that delays and cuts its control
        # traffic; a fetch lane (a second port, beside the proxied one) would carry the
        # fetches past the faults this harness exists to inject.
        config["fetch_lane"] = False
        if self.producer_hosts:
            host = self.producer_hosts[index]
            config.update(listen_host=host.ip, ucx_net_devices=DEVICE)
        return config

    def lease_of(self, index: int) -> float:
        return (
            float(SHRUNK_LEASE["grant_lease_s"])
            if index in self.shrunk
            else self.config.grant_lease_s
        )

    def start_producer(self, index: int, port: int = 0) -> Child:
        self._seed_ids += 1
        spec = ProducerSpec(
            config={**self.producer_config_of(index), "listen_port": port},
            fingerprint=FINGERPRINT,
            working_set=self.o.working_set,
            churn_per_s=self.o.churn_per_s,
            seed=self.seed * 1000 + self._seed_ids,
            netns=self.producer_hosts[index].netns if self.producer_hosts else "",
        )
        child = Child(
            "producer",
            index,
            producer_main,
            spec,
            self._on_event,
            start_timeout_s=_START_TIMEOUT_S,
            verbose=self.o.verbose,
            # What it writes there tells the known UCX abort from a crash.
            stderr=StderrTap(self.workdir / f"producer-{index}-{self._seed_ids}.stderr"),
        )
        self.producers[index] = child
        self.ports[index] = child.ready.port
        stats = self._stats(child)
        if stats is not None:
            self.evictions[child.pid] = (stats.store.evictions, stats.store.evictions)
        return child

    def start_consumer(self, *, push_shrunk: bool = False) -> Child:
        self._consumer_ids += 1
        config = dict(self.consumer_config)
        host = None
        if self.hosts is not None:
            host = self.hosts.add()
            config["ucx_net_devices"] = DEVICE
        push_name = f"consumer-{self._consumer_ids}" if self.o.push else ""
        if push_name:
            config["push_name"] = push_name
            if push_shrunk:
                config["push_deadline_s"] = SHRUNK_PUSH_DEADLINE_S
        spec = ConsumerSpec(
            config=config,
            fingerprint=FINGERPRINT,
            netns=host.netns if host else "",
            working_set=self.o.working_set,
            # Sessions to every producer from the start: the push channel.
            peers=[p.address for p in self.proxies] if push_name else [],
        )
        child = Child(
            "consumer",
            self._consumer_ids,
            consumer_main,
            spec,
            self._on_event,
            start_timeout_s=_START_TIMEOUT_S,
            verbose=self.o.verbose,
        )
        child.push_name = push_name
        child.push_shrunk = push_shrunk
        self.consumers.append(child)
        if host is not None:
            self.consumer_hosts[child.pid] = host
        return child

    def _stats(self, child: Child, *, verify: bool = False) -> NodeStats | None:
        try:
            stats = child.stats(_STATS_TIMEOUT_S, verify=verify)
        except ChildGone as exc:
            if child.answers() and not child.exited(1.0):  # a crash counts as one
                self.hangs += 1
                self.tally.violations.append(f"no stats: {exc}")
            return None
        self.canary_violations[child.pid] = stats.store.canary_violations
        if child.role == "producer":
            self.producer_counters[child.pid] = stats.counters
        else:
            self.consumer_counters[child.pid] = stats.counters
        if child.role == "producer" and child.pid in self.evictions:
            first, _ = self.evictions[child.pid]
            self.evictions[child.pid] = (first, stats.store.evictions)
        return stats

    def reap_crashes(self, *, replace: bool = True) -> None:
        """A child that exited by itself broke a promise: count it (and replace it)."""
        for index, child in enumerate(self.producers):
            if child is not None and child.crashed():
                evidence = self._ucx_abort_evidence(child)
                if evidence is None:
                    self._crashed(child)
                else:
                    self._known_ucx_abort(child, evidence)
                self._lose_pushes(child)
                self.producers[index] = None
                if replace:
                    self._later(0.2, "restart", partial(self._restart_producer, index))
        for child in [c for c in self.consumers if c.crashed()]:
            self._crashed(child)
            self._retire_consumer(child)
            self._lose_fetches(child)
            if replace:
                self.start_consumer()

    def _retire_consumer(self, child: Child) -> None:
        self.consumers.remove(child)
        host = self.consumer_hosts.pop(child.pid, None)
        if host is not None and self.hosts is not None and not child.process.is_alive():
            self.hosts.give_back(host)  # its namespace is empty: a new consumer may have it

    def _lose_pushes(self, producer: Child) -> None:
        """Pushes of a producer that is gone: no outcome is owed (it was SIGKILLed), or
        the ones it owed came before it exited (`drained`)."""
        lost = [k for k, p in self.pending_pushes.items() if p.producer is producer]
        for k in lost:
            del self.pending_pushes[k]
        self.pushes.lost_with_producer += len(lost)

    def _lose_fetches(self, consumer: Child) -> None:
        lost = [k for k, p in self.pending.items() if p.consumer is consumer]
        for k in lost:
            del self.pending[k]
        self.tally.lost_with_consumer += len(lost)

    def _crashed(self, child: Child) -> None:
        self.crashes += 1
        what = f"{child.name} exited by itself (exit code {child.process.exitcode})"
        last = _last_line(child.stderr.text(2.0)) if child.stderr is not None else ""
        if last:
            what += f", its stderr ending {last!r}"
        self.log(what)
        self.retired.append(child)
        self.tally.violations.append(what)

    def _ucx_abort_evidence(self, child: Child) -> str | None:
        if child.stderr is None:
            return None
        return ucx_abort_evidence(
            exitcode=child.process.exitcode,
            stderr=child.stderr.text(2.0),
            transport=self.o.ucx_tls,
            stops=child.stops,
            ends=self.consumer_ends,
            died_at_s=self.clock(),
        )

    def _known_ucx_abort(self, child: Child, evidence: str) -> None:
        """UCX 1.23's abort in a producer resumed from a stop around which a consumer
        ended (docs/RELIABILITY.md): counted apart, not a crash, and restarted like one."""
        what = f"{child.name} died of the known UCX abort: {evidence}"
        self.log(what)
        self.known_ucx_aborts.append(f"{self.clock():.3f} s: {what}")
        self.retired.append(child)

    def _stopped(self, child: Child, kind: str) -> None:
        """`child` is stopped by the fault `kind` (until `_resume`)."""
        child.stopped_by = (kind, self.clock())

    def _consumer_ended(self, child: Child, kind: str) -> None:
        """`child`, a consumer, was ended by the fault `kind`: SIGKILLed, or stopped to
        be replaced."""
        self.consumer_ends.append(ConsumerEnd(kind, child.name, self.clock()))

    def _later(self, delay_s: float, label: str, action: Callable[[], None]) -> None:
        self.scheduled.append((time.monotonic() + delay_s, label, action))

    def _running_producers(self) -> list[int]:
        """Live producers that are not paused or armed: the ones a fault may take."""
        return [i for i, c in enumerate(self.producers) if c is not None and c.answers()]

    def _ready_consumers(self) -> list[Child]:
        """Consumers that answer: the ones a fault may take."""
        return [c for c in self.consumers if c.answers()]

    def _restart_producer(self, index: int, attempt: int = 0) -> None:
        try:
            child = self.start_producer(index, self.ports[index])
            self.faults["restarts_same_key_and_port"] += 1
            lease = " (shrunk lease)" if index in self.shrunk else ""
            self.log(f"restarted {child.name}{lease}")
        except ChildGone as exc:
            # The port may still be held for a moment by the dead incarnation.
            if attempt >= 10:
                self.tally.violations.append(f"producer {index} did not restart: {exc}")
                return
            self._later(0.5, "restart", lambda: self._restart_producer(index, attempt + 1))

    def _stop_and_restart(self, index: int) -> None:
        child = self.producers[index]
        assert child is not None
        self._stats(child)  # its last word on writes after free
        self.producers[index] = None
        if not child.stop(self.config.shutdown_timeout_s + 5.0):
            self.hangs += 1
            self.tally.violations.append(f"{child.name} did not exit when told to stop")
        self.retired.append(child)
        # What it said before it exited (its pushes end as it stops) is heard first.
        child.drained(5.0)
        self.collect(0.0)
        self._lose_pushes(child)
        self._restart_producer(index)

    # -- arming and resuming ----------------------------------------------------------------

    def _arm(self, child: Child, kind: str, *, freeze: bool, fetch: bool = False) -> bool:
        # Set before the child can answer: its answer is handled on another thread.
        child.strike_s = self._strike_seconds(kind, child)
        child.armed = kind
        push = kind in MID_PUSH_KINDS
        try:
            child.send(Arm(kind, self.o.large_read_bytes, self.o.read_wait_s, freeze, push, fetch))
        except ChildGone:
            child.armed = ""
            return False
        self.log(f"armed {kind} on {child.name}")
        return True

    def _arm_producer(self, kind: str, *, freeze: bool) -> bool:
        live = self._running_producers()
        if not live:
            return False
        child = self.producers[self.rng.choice(live)]
        assert child is not None
        return self._arm(child, kind, freeze=freeze)

    def _strike_seconds(self, kind: str, child: Child) -> float:
        """How long the fault lasts once it strikes `child` (drawn when it is armed)."""
        raise NotImplementedError

    def _resume_in(self, child: Child, seconds: float) -> None:
        """SIGCONT after `seconds`, on a timer: on time even while the main loop is busy
        (a restart blocks it for seconds), as a stop longer than planned would make a
        frozen consumer's fetches late by the harness's hand."""
        timer = threading.Timer(seconds, self._resume, args=(child,))
        timer.daemon = True
        self.resumes.append(timer)
        timer.start()

    def _resume(self, child: Child) -> None:
        if child.alive():
            child.resume()
            if child.stopped_by is not None:
                kind, start_s = child.stopped_by
                child.stops.append(Stop(kind, start_s, self.clock()))
                child.stopped_by = None
            self.log(f"resumed {child.name}")

    def armed_children(self) -> list[Child]:
        return [c for c in [*filter(None, self.producers), *self.consumers] if c.armed]


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][-300:] if lines else ""
