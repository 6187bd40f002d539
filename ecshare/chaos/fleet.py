"""The harness's processes: starting and restarting them, and the faults injected into them.

Producers are killed (and restarted under the same key and port), paused for
longer than a lease and restarted cleanly; consumers are killed and replaced;
control connections are cut and delayed through their `FaultProxy`.

The faults aimed at reads in flight (`MID_READ_KINDS`) are armed first: the
target child is told to watch for a read of at least `large_read_bytes` in
flight (`Arm`), and the fault strikes when it answers (`on_read_in_flight`).
A child that freezes stops itself right after answering, so the read is still
moving (over UCX TCP) when it stops:

- `freeze_producer_mid_read`: a producer serving a large read is stopped for
  1.1 to 1.6 times its lease; its grants may expire while it sleeps.
- `readd_peer`: the same, for long enough that consumers' heartbeats quarantine
  it (their links close and the transport removes the peer with the read in
  flight) but shorter than the lease and the deadline, so that on SIGCONT the
  consumers say hello again and add the peer back while that read still moves.
- `freeze_consumer_mid_read`: a consumer with a large read in flight is stopped
  past the producers' heartbeat timeout; the producers end its sessions while
  the read is stalled, and on SIGCONT it finds its sessions gone and starts new
  ones.
- `partition_control`: one producer's control path is held both ways (not
  reset) past both sides' heartbeat timeouts while its large read moves; NIXL's
  data path is untouched.

With push traffic (`push` > 0) the faults aimed at pushes (`PUSH_KINDS`) arm
the same way, for a push of at least `large_read_bytes` in flight (a producer:
offered or being written; a consumer: blocks reserved for it):

- `kill_producer_mid_push`, `kill_consumer_mid_push`: the target stops itself
  at the push and is SIGKILLed there; a producer is restarted under its key and
  port, a consumer replaced.
- `freeze_producer_mid_push`: stopped for half to 1.2 times its lease, past the
  consumers' heartbeat timeout: they fence the reservation and probe it, and
  the write runs on once the producer does.
- `freeze_consumer_mid_push`: as `freeze_consumer_mid_read`, with blocks
  reserved for a push that is being written.
- `cut_control_mid_push`: every control connection through the producer's
  proxy is reset and the path held past both sides' heartbeat timeouts while
  the write moves: both live, both end the session.

`shrink_push_deadline` replaces a consumer with one that gives a push
`SHRUNK_PUSH_DEADLINE_S` to land once reserved (or back), so most of its pushes
run late, are fenced and pulled; `fill_consumer_region` fills a consumer's
region with half-written entries for 0.5 to 1.5 s, so offers are refused
(full).

`shrink_lease` restarts a producer cleanly under `SHRUNK_LEASE`, a lease
shorter than the consumers' own deadline (or back to the normal lease, when
every producer already runs shrunk).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from functools import partial

from ecshare.chaos.hosts import DEVICE
from ecshare.chaos.messages import (
    Arm,
    ConsumerSpec,
    Fill,
    NodeStats,
    Outcome,
    ProducerSpec,
    PushEnded,
    ReadInFlight,
)
from ecshare.chaos.nodes import Child, ChildGone, consumer_main, producer_main
from ecshare.chaos.options import (
    _START_TIMEOUT_S,
    _STATS_TIMEOUT_S,
    ARMED_KINDS,
    FINGERPRINT,
    MID_PUSH_KINDS,
    SHRUNK_LEASE,
    SHRUNK_PUSH_DEADLINE_S,
)
from ecshare.chaos.state import RunState


class Fleet(RunState):
    def collect(self, timeout_s: float) -> None:
        """Act on what children said unasked (`Load` does)."""
        raise NotImplementedError

    # -- processes ---------------------------------------------------------------------------

    def _on_event(self, child: Child, event: Outcome | PushEnded | ReadInFlight) -> None:
        # From the child's reader thread; the main loop does the rest.
        if isinstance(event, ReadInFlight) and event.nbytes and not child.killed:
            self._strike(child, event)
        self.events.put((child, event))

    def producer_config_of(self, index: int) -> dict[str, object]:
        config = {**self.producer_config, **(SHRUNK_LEASE if index in self.shrunk else {})}
        if self.producer_hosts:
            host = self.producer_hosts[index]
            config.update(listen_host=host.ip, ucx_net_devices=DEVICE)
        return config

    def lease_of(self, index: int) -> float:
        return float(SHRUNK_LEASE["lease_s"]) if index in self.shrunk else self.config.lease_s

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
                self._crashed(child)
                self._lose_pushes(child)
                self.producers[index] = None
                if replace:
                    self._later(0.2, "restart", partial(self._restart_producer, index))
        for child in [c for c in self.consumers if c.crashed()]:
            self._crashed(child)
            self._retire_consumer(child)
            lost = [k for k, p in self.pending.items() if p.consumer is child]
            for k in lost:
                del self.pending[k]
            self.tally.lost_with_consumer += len(lost)
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
        self.log(f"{child.name} exited by itself (exit code {child.process.exitcode})")
        self.retired.append(child)
        self.tally.violations.append(
            f"{child.name} exited by itself (exit code {child.process.exitcode})"
        )

    # -- faults ------------------------------------------------------------------------------

    def _later(self, delay_s: float, label: str, action: Callable[[], None]) -> None:
        self.scheduled.append((time.monotonic() + delay_s, label, action))

    def _running_producers(self) -> list[int]:
        """Live producers that are not paused or armed: the ones a fault may take."""
        return [i for i, c in enumerate(self.producers) if c is not None and c.answers()]

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

    def inject(self) -> None:
        # Dealt from a shuffled deck, so every kind comes up once per round; a kind
        # that cannot apply now (no busy consumer, say) waits in the deck. An armed
        # kind counts once it strikes (`on_read_in_flight`).
        if not self._deck:
            self._deck = list(self.o.faults)
            self.rng.shuffle(self._deck)
        for kind in list(self._deck):
            if getattr(self, f"_fault_{kind}")():
                self._deck.remove(kind)
                if kind not in ARMED_KINDS:
                    self.faults[kind] += 1
                return

    def _fault_kill_producer(self) -> bool:
        live = self._running_producers()
        if not live:
            return False
        index = self.rng.choice(live)
        child = self.producers[index]
        assert child is not None
        self._stats(child)  # its last word on writes after free
        child.kill()
        self.log(f"kill_producer {child.name}")
        self.retired.append(child)
        self._lose_pushes(child)
        self.producers[index] = None
        self._later(self.rng.uniform(0.2, 1.5), "restart", lambda: self._restart_producer(index))
        return True

    def _fault_restart_producer(self) -> bool:
        """A clean stop and a start under the same key and port."""
        live = self._running_producers()
        if not live:
            return False
        index = self.rng.choice(live)
        self.log(f"restart_producer {index}")
        self._stop_and_restart(index)
        return True

    def _fault_shrink_lease(self) -> bool:
        """A clean restart under a lease shorter than the consumers' deadline (or back)."""
        live = self._running_producers()
        if not live:
            return False
        normal = [i for i in live if i not in self.shrunk]
        index = self.rng.choice(normal or live)
        if index in self.shrunk:
            self.shrunk.discard(index)
            self.faults["lease_restored"] += 1
        else:
            self.shrunk.add(index)
        self.log(f"shrink_lease producer {index}: lease {self.lease_of(index)} s")
        self._stop_and_restart(index)
        return True

    def _fault_pause_producer(self) -> bool:
        live = self._running_producers()
        if not live:
            return False
        index = self.rng.choice(live)
        child = self.producers[index]
        assert child is not None
        child.pause()
        # Longer than a lease: grants it made may expire while it sleeps.
        pause_s = self.lease_of(index) * self.rng.uniform(1.1, 1.6)
        self.log(f"pause_producer {child.name} for {pause_s:.2f} s")
        self._resume_in(child, pause_s)
        return True

    def _fault_kill_consumer(self) -> bool:
        busy = [c for c in self.consumers if any(p.consumer is c for p in self.pending.values())]
        if not busy:
            return False
        victim = self.rng.choice(busy)
        if victim.answers():
            self._stats(victim)  # its last word on writes after free
        victim.kill()
        self.log(f"kill_consumer {victim.name}")
        self.retired.append(victim)
        self._retire_consumer(victim)
        self._lose_fetches(victim)
        self.start_consumer()
        return True

    def _fault_cut_control(self) -> bool:
        index = self.rng.randrange(len(self.proxies))
        self.proxies[index].cut_all()
        self.log(f"cut_control of producer {index}")
        return True

    def _fault_delay_control(self) -> bool:
        # Up to 1.5x the request timeout: some replies arrive after the consumer
        # gave up on them, and their grants must still come back.
        index = self.rng.randrange(len(self.proxies))
        seconds = self.rng.uniform(0.5, 2.0)
        self.proxies[index].delay_burst(seconds, self.config.request_timeout_s * 1.5)
        self.log(f"delay_control of producer {index} for {seconds:.2f} s")
        return True

    # -- faults that wait for a read in flight -----------------------------------------------

    def _arm(self, child: Child, kind: str, *, freeze: bool) -> bool:
        # Set before the child can answer: its answer is handled on another thread.
        child.strike_s = self._strike_seconds(kind, child)
        child.armed = kind
        push = kind in MID_PUSH_KINDS
        try:
            child.send(Arm(kind, self.o.large_read_bytes, self.o.read_wait_s, freeze, push))
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

    def _fault_freeze_producer_mid_read(self) -> bool:
        return self._arm_producer("freeze_producer_mid_read", freeze=True)

    def _fault_readd_peer(self) -> bool:
        return self._arm_producer("readd_peer", freeze=True)

    def _fault_partition_control(self) -> bool:
        return self._arm_producer("partition_control", freeze=False)

    def _fault_freeze_consumer_mid_read(self) -> bool:
        ready = [c for c in self.consumers if c.answers()]
        if not ready:
            return False
        return self._arm(self.rng.choice(ready), "freeze_consumer_mid_read", freeze=True)

    # -- faults aimed at push traffic ------------------------------------------------------

    def _fault_kill_producer_mid_push(self) -> bool:
        return self._arm_producer("kill_producer_mid_push", freeze=True)

    def _fault_freeze_producer_mid_push(self) -> bool:
        return self._arm_producer("freeze_producer_mid_push", freeze=True)

    def _fault_cut_control_mid_push(self) -> bool:
        return self._arm_producer("cut_control_mid_push", freeze=False)

    def _fault_kill_consumer_mid_push(self) -> bool:
        ready = [c for c in self.consumers if c.answers()]
        if not ready:
            return False
        return self._arm(self.rng.choice(ready), "kill_consumer_mid_push", freeze=True)

    def _fault_freeze_consumer_mid_push(self) -> bool:
        ready = [c for c in self.consumers if c.answers()]
        if not ready:
            return False
        return self._arm(self.rng.choice(ready), "freeze_consumer_mid_push", freeze=True)

    def _fault_shrink_push_deadline(self) -> bool:
        """A consumer is replaced by one that gives pushes SHRUNK_PUSH_DEADLINE_S to land
        (or, when it ran so already, by one under the normal deadline)."""
        ready = [c for c in self.consumers if c.answers()]
        if not ready:
            return False
        victim = self.rng.choice(ready)
        shrunk = not victim.push_shrunk
        if not shrunk:
            self.faults["push_deadline_restored"] += 1
        self._stats(victim)  # its last word on writes after free
        if not victim.stop(self.config.shutdown_timeout_s + 5.0):
            self.hangs += 1
            self.tally.violations.append(f"{victim.name} did not exit when told to stop")
        self.retired.append(victim)
        self._retire_consumer(victim)
        # Its fetches ended (typed: shutdown) as it stopped; hear them before counting.
        victim.drained(5.0)
        self.collect(0.0)
        self._lose_fetches(victim)
        child = self.start_consumer(push_shrunk=shrunk)
        deadline = SHRUNK_PUSH_DEADLINE_S if shrunk else self.config.push_deadline_s
        self.log(f"shrink_push_deadline: {victim.name} replaced by {child.name}, {deadline} s")
        return True

    def _fault_fill_consumer_region(self) -> bool:
        """A consumer's region has no room for a while: offers are refused (full)."""
        ready = [c for c in self.consumers if c.answers()]
        if not ready:
            return False
        victim = self.rng.choice(ready)
        seconds = self.rng.uniform(0.5, 1.5)
        try:
            victim.send(Fill(seconds))
        except ChildGone:
            return False
        self.log(f"fill_consumer_region {victim.name} for {seconds:.2f} s")
        return True

    def _strike_seconds(self, kind: str, child: Child) -> float:
        """How long the fault lasts once it strikes `child` (drawn when it is armed)."""
        cfg = self.config
        hb = cfg.heartbeat_timeout_s
        if kind in ("kill_producer_mid_push", "kill_consumer_mid_push"):
            return 0.0
        if kind == "freeze_producer_mid_push":
            # Past the consumers' heartbeat timeout: they lose the session, fence the
            # reservation and probe; the write runs on once the producer does.
            return self.lease_of(child.index) * self.rng.uniform(0.5, 1.2)
        if kind == "freeze_consumer_mid_push":
            # As freeze_consumer_mid_read: past the producers' heartbeat timeout, within
            # the grace its own fetches have.
            return self.rng.uniform(1.2 * hb, max(1.2 * hb, min(2.0 * hb, self.o.grace_s - 0.5)))
        if kind == "cut_control_mid_push":
            # Connections reset, and the path stays cut past both heartbeat timeouts.
            return self.rng.uniform(1.2 * hb, max(1.2 * hb, self.lease_of(child.index)))
        if kind == "freeze_producer_mid_read":
            return self.lease_of(child.index) * self.rng.uniform(1.1, 1.6)
        if kind == "readd_peer":
            # Past the consumers' heartbeat timeout and their quarantine, so that they
            # drop the peer and say hello again; within the lease and the deadline.
            low = hb + cfg.heartbeat_interval_s + cfg.quarantine_s
            high = 0.9 * min(self.lease_of(child.index), cfg.fetch_deadline_max_s)
            return self.rng.uniform(low, max(low, high))
        if kind == "freeze_consumer_mid_read":
            # Past the producers' heartbeat timeout, and well within the grace: a
            # stopped consumer cannot end its fetches, so a longer stop would make
            # them late by the harness's hand.
            return self.rng.uniform(1.2 * hb, max(1.2 * hb, min(2.0 * hb, self.o.grace_s - 0.5)))
        # partition_control: past both sides' heartbeat timeouts, up to a lease.
        return self.rng.uniform(1.2 * hb, max(1.2 * hb, self.lease_of(child.index)))

    def _strike(self, child: Child, event: ReadInFlight) -> None:
        """On the child's reader thread, as soon as it answers: the main loop may be
        busy for seconds (a restart blocks it), and a freeze longer than drawn would
        make a frozen consumer's fetches late by the harness's hand."""
        if event.kind in ("kill_producer_mid_push", "kill_consumer_mid_push"):
            # Frozen on its own at the push: it dies there (the books: the main loop).
            child.struck_kill = True
            child.killed = True
            child.signal(signal.SIGKILL)
            return
        if event.frozen:
            child.paused = True
            self._resume_in(child, child.strike_s)
        if event.kind == "cut_control_mid_push":
            proxy = self.proxies[child.index]
            proxy.cut_all()
            proxy.hold(child.strike_s)
        if event.kind == "partition_control":
            proxy = self.proxies[child.index]
            proxy.hold(child.strike_s)
            now = time.monotonic()
            self.partitions.append((proxy.address, now, now + child.strike_s))

    def on_read_in_flight(self, child: Child, event: ReadInFlight) -> None:
        """The main loop's part of an armed child's answer: the books."""
        child.armed = ""
        if child.struck_kill:
            self._killed_mid_push(child, event)
            return
        if child.killed:
            return
        if not event.nbytes:
            what = "push" if event.kind in MID_PUSH_KINDS else "read"
            self.faults[f"mid_{what}_misses"] += 1
            self.log(f"missed {event.kind} on {child.name}: no large {what} in flight")
            return
        self.faults[event.kind] += 1
        what = "push" if event.kind in MID_PUSH_KINDS else "read"
        self.log(
            f"{event.kind} {child.name}: {event.nbytes} B {what} in flight, {child.strike_s:.2f} s"
        )

    def _killed_mid_push(self, child: Child, event: ReadInFlight) -> None:
        child.kill()  # reaped
        self.faults[event.kind] += 1
        self.log(f"{event.kind} {child.name}: {event.nbytes} B push in flight")
        self.retired.append(child)
        if child.role == "producer":
            self._lose_pushes(child)
            if self.producers[child.index] is child:
                self.producers[child.index] = None
                index = child.index
                self._later(
                    self.rng.uniform(0.2, 1.5), "restart", lambda: self._restart_producer(index)
                )
        else:
            if child in self.consumers:
                self._retire_consumer(child)
            self._lose_fetches(child)
            self.start_consumer(push_shrunk=child.push_shrunk)

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
            self.log(f"resumed {child.name}")

    def armed_children(self) -> list[Child]:
        return [c for c in [*filter(None, self.producers), *self.consumers] if c.armed]


def _due(item: tuple[float, str, Callable[[], None]]) -> float:
    return item[0]
