"""Faults aimed at push traffic.

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
"""

from __future__ import annotations

from ecshare.apps.chaos.messages import Fill, ReadInFlight
from ecshare.apps.chaos.nodes import Child, ChildGone
from ecshare.apps.chaos.options import SHRUNK_PUSH_DEADLINE_S
from ecshare.apps.chaos.processes import Processes


class PushFaults(Processes):
    def _fault_kill_producer_mid_push(self) -> bool:
        return self._arm_producer("kill_producer_mid_push", freeze=True)

    def _fault_freeze_producer_mid_push(self) -> bool:
        return self._arm_producer("freeze_producer_mid_push", freeze=True)

    def _fault_cut_control_mid_push(self) -> bool:
        return self._arm_producer("cut_control_mid_push", freeze=False)

    def _fault_kill_consumer_mid_push(self) -> bool:
        ready = self._ready_consumers()
        if not ready:
            return False
        return self._arm(self.rng.choice(ready), "kill_consumer_mid_push", freeze=True)

    def _fault_freeze_consumer_mid_push(self) -> bool:
        ready = self._ready_consumers()
        if not ready:
            return False
        return self._arm(self.rng.choice(ready), "freeze_consumer_mid_push", freeze=True)

    def _fault_shrink_push_deadline(self) -> bool:
        """A consumer is replaced by one that gives pushes SHRUNK_PUSH_DEADLINE_S to land
        (or, when it ran so already, by one under the normal deadline)."""
        ready = self._ready_consumers()
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
        self._consumer_ended(victim, "shrink_push_deadline")
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
        ready = self._ready_consumers()
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
