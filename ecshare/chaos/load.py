"""The load of a chaos run: fetches fed to the consumers, and their outcomes tallied."""

from __future__ import annotations

import queue

from ecshare.chaos.fleet import Fleet
from ecshare.chaos.messages import Fetch, Outcome
from ecshare.chaos.nodes import ChildGone
from ecshare.chaos.state import _Pending


class Load(Fleet):
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
            # While a fault waits for a large read in flight, the load provides some.
            keys = self.large_keys if self.armed_children() else self.keys
            picks = [k for k in self.rng.sample(keys, min(len(keys), n * 3)) if k[0] not in busy]
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
            except ChildGone:
                for fetch_id, _, _ in items:
                    self.pending.pop(fetch_id, None)
                continue  # it died by itself: `reap_crashes` counts and replaces it
            self.tally.attempted += len(items)

    def collect(self, timeout_s: float) -> None:
        """Act on what children said unasked, waiting up to `timeout_s` for the first."""
        try:
            child, event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            if isinstance(event, Outcome):
                self._record(event)
            else:
                self.on_read_in_flight(child, event)
            try:
                child, event = self.events.get_nowait()
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
                f"{outcome.mm_hash} settled {outcome.status} ({outcome.reason}) after "
                f"{outcome.settle_s:.2f} s, bound {pending.bound_s:.2f} s, in "
                f"{pending.consumer.name} at {outcome.settled_at - self.load_started:.3f} s"
            )
        if outcome.status == "delivered":
            t.delivered += 1
            t.delivered_bytes += pending.nbytes
            if any(
                peer == outcome.detail and start < outcome.settled_at < end
                for peer, start, end in self.partitions
            ):
                # Its grant came before the partition, its data moved during it.
                self.faults["reads_done_under_partition"] += 1
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
