"""The faults the harness injects into its processes (`Processes` starts them).

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
  ones. Over cross-memory attach a consumer's read runs inside one call on its
  network thread, which holds the GIL throughout, so no other thread ever sees
  it in flight (the fault used to strike by luck, after many misses): there
  the consumer is stopped with a large fetch in flight (asked for, granted or
  being read), its grant held at the producer while it sleeps.
- `partition_control`: one producer's control path is held both ways (not
  reset) past both sides' heartbeat timeouts while its large read moves; NIXL's
  data path is untouched.

With push traffic the faults aimed at pushes join the deck; they are
`PushFaults`' (`ecshare/apps/chaos/push_faults.py`), and strike through the same
`Arm` and `on_read_in_flight`.

`shrink_lease` restarts a producer cleanly under `SHRUNK_LEASE`, a lease
shorter than the consumers' own deadline (or back to the normal lease, when
every producer already runs shrunk).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from ecshare.apps.chaos.messages import Outcome, PushEnded, ReadInFlight
from ecshare.apps.chaos.nodes import Child
from ecshare.apps.chaos.options import ARMED_KINDS, MID_PUSH_KINDS
from ecshare.apps.chaos.push_faults import PushFaults


class Fleet(PushFaults):
    def _on_event(self, child: Child, event: Outcome | PushEnded | ReadInFlight) -> None:
        # From the child's reader thread: an armed fault strikes at once.
        if isinstance(event, ReadInFlight) and event.nbytes and not child.killed:
            self._strike(child, event)
        super()._on_event(child, event)

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

    def _pick_producer(self) -> int | None:
        """One of the producers a fault may take, drawn at random; None if none may."""
        live = self._running_producers()
        return self.rng.choice(live) if live else None

    def _fault_kill_producer(self) -> bool:
        index = self._pick_producer()
        if index is None:
            return False
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
        index = self._pick_producer()
        if index is None:
            return False
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
        index = self._pick_producer()
        if index is None:
            return False
        child = self.producers[index]
        assert child is not None
        child.pause()
        self._stopped(child, "pause_producer")
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
        self._consumer_ended(victim, "kill_consumer")
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

    # -- faults that wait for a read in flight ----------------------------------------------

    def _fault_freeze_producer_mid_read(self) -> bool:
        return self._arm_producer("freeze_producer_mid_read", freeze=True)

    def _fault_readd_peer(self) -> bool:
        return self._arm_producer("readd_peer", freeze=True)

    def _fault_partition_control(self) -> bool:
        return self._arm_producer("partition_control", freeze=False)

    def _fault_freeze_consumer_mid_read(self) -> bool:
        ready = self._ready_consumers()
        if not ready:
            return False
        # Over cross-memory attach a read runs inside one call: see the module docstring.
        fetch = self.o.ucx_tls == "cma"
        child = self.rng.choice(ready)
        return self._arm(child, "freeze_consumer_mid_read", freeze=True, fetch=fetch)

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
            if child.role == "consumer":
                self._consumer_ended(child, event.kind)
            return
        if event.frozen:
            child.paused = True
            self._stopped(child, event.kind)
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


def _due(item: tuple[float, str, Callable[[], None]]) -> float:
    return item[0]
