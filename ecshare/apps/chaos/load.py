"""The load of a chaos run: fetches fed to the consumers, and their outcomes tallied."""

from __future__ import annotations

import queue

from ecshare.apps.chaos.fleet import Fleet
from ecshare.apps.chaos.messages import Fetch, Outcome, Push, PushEnded
from ecshare.apps.chaos.nodes import Child, ChildGone
from ecshare.apps.chaos.options import MID_PUSH_KINDS
from ecshare.apps.chaos.state import _Pending, _PendingPush
from ecshare.protocol import PushStatus


class Load(Fleet):
    def feed(self) -> None:
        armed = self.armed_children()
        push_armed = [c for c in armed if c.armed in MID_PUSH_KINDS]
        for consumer in list(self.consumers):
            mine = [p for p in self.pending.values() if p.consumer is consumer]
            pushes = [p for p in self.pending_pushes.values() if p.to == consumer.push_name]
            room = self.o.inflight_per_consumer - len(mine) - len(pushes)
            if room <= 0 or (not self.o.soak_s and self.tally.attempted >= self.budget):
                continue
            busy = {p.mm_hash for p in mine} | {p.mm_hash for p in pushes}
            n = min(room, self.rng.randint(1, self.o.batch_max))
            if not self.o.soak_s:
                n = min(n, self.budget - self.tally.attempted)
            # While a fault waits for a large read or push in flight, the load provides some.
            keys = self.large_keys if armed else self.keys
            picks = [k for k in self.rng.sample(keys, min(len(keys), n * 3)) if k[0] not in busy]
            picks = picks[:n]
            if not picks:
                continue
            pusher = self._pusher_for(consumer, push_armed)
            # Pushed items are fetched at once, announced as pushed (the fetch waits for
            # the push) or not (it may race the offer), or left to later fetches.
            mode = self.rng.random() if pusher is not None else 1.0
            announced = mode < 0.5
            if pusher is not None:
                self._push(pusher, consumer, picks)
                if mode >= 0.75:
                    continue
            self._fetch(consumer, picks, announced=announced)

    def _pusher_for(self, consumer: Child, push_armed: list[Child]) -> Child | None:
        """The producer to push this batch to `consumer`, if the batch is to be pushed."""
        if not self.o.push or not consumer.push_name:
            return None
        armed_producers = [c for c in push_armed if c.role == "producer" and c.alive()]
        if not push_armed and self.rng.random() >= self.o.push:
            return None
        if armed_producers:
            return self.rng.choice(armed_producers)
        live = [c for c in self.producers if c is not None and c.alive() and not c.paused]
        return self.rng.choice(live) if live else None

    def _push(self, producer: Child, consumer: Child, picks: list[tuple[str, int]]) -> None:
        items = []
        for h, _ in picks:
            self._push_ids += 1
            items.append((self._push_ids, h))
            self.pending_pushes[self._push_ids] = _PendingPush(
                self._push_ids, h, producer, consumer.push_name
            )
        try:
            producer.send(Push(items, consumer.push_name))
        except ChildGone:
            for push_id, _ in items:
                self.pending_pushes.pop(push_id, None)
            return
        self.pushes.attempted += len(items)

    def _fetch(self, consumer: Child, picks: list[tuple[str, int]], *, announced: bool) -> None:
        peers = [p.address for p in self.proxies]
        self.rng.shuffle(peers)
        items = []
        for h, nbytes in picks:
            self._fetch_ids += 1
            items.append((self._fetch_ids, h, nbytes))
            self.pending[self._fetch_ids] = _Pending(
                self._fetch_ids, h, nbytes, consumer, self._bound(nbytes, announced)
            )
        try:
            consumer.send(Fetch(items, peers, announced))
        except ChildGone:
            for fetch_id, _, _ in items:
                self.pending.pop(fetch_id, None)
            return  # it died by itself: `reap_crashes` counts and replaces it
        self.tally.attempted += len(items)

    def _bound(self, nbytes: int, announced: bool) -> float:
        """How long a fetch may take to settle: its deadline, plus the grace. Where pushes
        run, a fetch waits up to `push_wait_s` for an announced push's offer, and any
        fetch may meet a reservation, whose own deadline it waits out before pulling."""
        cfg = self.config
        bound = cfg.fetch_deadline_s(nbytes) + self.o.grace_s
        if self.o.push:
            push_deadline = cfg.push_deadline_s + cfg.fetch_deadline_per_gib_s * nbytes / (1 << 30)
            bound += push_deadline + cfg.push_wait_s * (2 if announced else 1)
        return bound

    def collect(self, timeout_s: float) -> None:
        """Act on what children said unasked, waiting up to `timeout_s` for the first."""
        try:
            child, event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            if isinstance(event, Outcome):
                self._record(event)
            elif isinstance(event, PushEnded):
                self._record_push(event)
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
            self.pushes.delivered_pushed += outcome.pushed
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

    def _record_push(self, ended: PushEnded) -> None:
        pending = self.pending_pushes.pop(ended.push_id, None)
        if pending is None:
            return  # from a producer that was killed meanwhile: already counted as lost
        self.pushes.ended[push_reason(ended.state, ended.detail)] += 1
        self.pushes.max_settle_s = max(self.pushes.max_settle_s, ended.settle_s)


def push_reason(state: str, detail: str) -> str:
    """One push's end, as a report key: "pushed", or its state and reason in short."""
    if state == "pushed":
        return "pushed"
    for prefix, short in (
        ("no push session", "no push session"),
        ("max_pushes_in_flight", "producer busy"),
        ("write failed", "write failed"),
        ("no answer to the offer", "no answer"),
        ("the consumer's session ended", "session ended"),
        ("producer stopping", "producer stopping"),
        ("reserved extents invalid", "extents invalid"),
    ):
        if detail.startswith(prefix):
            return f"{state}: {short}"
    if state == "refused" and detail in {s.value for s in PushStatus}:
        return f"{state}: {detail}"  # the consumer's answer
    return f"{state}: not ready here" if state == "refused" else f"{state}: {detail[:60]}"
