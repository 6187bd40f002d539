"""`ecshare chaos`: fetches between real processes under randomized faults, then the invariants.

Producers and consumers run as separate processes on 127.0.0.1 (real
Producer/Consumer, CURVE, NIXL), or each in a network namespace of its own
(`--netns`, see `hosts`); NIXL reads over UCX's choice (cross-memory attach on
one host) or over TCP (`--ucx-tls tcp`). Every consumer reaches every producer
through its own `FaultProxy`, so control messages can be delayed and lost.
While the consumers fetch, the harness SIGKILLs producers (restarted under the
same key and port) and consumers (replaced), pauses producers with SIGSTOP for
longer than a lease, restarts producers cleanly and under a shrunk lease, cuts,
delays and partitions control connections, freezes producers and consumers
while large reads are in flight (see `fleet`), and keeps every producer's
region smaller than its working set.

Once the fetches are done it lets the system go quiet and checks:

(a) no entry became READY in a consumer with wrong bytes;
(b) every surviving region has no pins, nothing half-written, and free + used
    = total, with every used block held by a READY entry;
(c) every fetch delivered the right bytes or ended with a typed `FetchFailed`,
    within its deadline plus a grace;
(d) no process hung: each answered within its bound and exited when told.

`--soak SECONDS` runs the same machinery without faults for a fixed time and
samples every process's RSS and every region's usage (see `Soak`).

`ChaosRun` is assembled from one part a job: `Fleet` (processes and faults),
`Load` (fetches and their outcomes), `SoakSampling` (memory and region usage)
and `Verdict` (the checks above and the report), over the state in `RunState`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ecshare.apps.chaos.faultproxy import FaultProxy, Faults
from ecshare.apps.chaos.fleet import _due
from ecshare.apps.chaos.hosts import HUB_IP, Hosts
from ecshare.apps.chaos.options import FAULT_KINDS as FAULT_KINDS
from ecshare.apps.chaos.options import SOAK_STRETCH, ChaosOptions
from ecshare.apps.chaos.options import TIMING as TIMING
from ecshare.apps.chaos.report import ChaosReport
from ecshare.apps.chaos.verdict import Verdict
from ecshare.apps.chaos.verdict import _region_check as _region_check


class ChaosRun(Verdict):
    def run(self) -> ChaosReport:
        o = self.o
        started = time.monotonic()
        try:
            if o.netns:
                self.hosts = Hosts(str(os.getpid()))
                self.producer_hosts = [self.hosts.add() for _ in range(o.producers)]
            for i in range(o.producers):
                self.start_producer(i)
            for i in range(o.producers):
                faults = Faults(o.control_delay_prob, o.control_max_delay_s, o.control_cut_prob)
                if self.hosts is not None:
                    # Proxies listen in the hub: control crosses the bridge both ways.
                    proxy = FaultProxy(
                        self.producer_hosts[i].ip,
                        self.ports[i],
                        faults=faults,
                        seed=self.seed + i,
                        listen_host=HUB_IP,
                        netns=self.hosts.hub,
                    )
                else:
                    proxy = FaultProxy(
                        "127.0.0.1", self.ports[i], faults=faults, seed=self.seed + i
                    )
                self.proxies.append(proxy)
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
        # Whether the load ran on past `fetches` waiting for a fault kind, and how many
        # fetches had been delivered when the last kind struck.
        extended = False
        delivered_at_last_kind: int | None = None
        while True:
            now = time.monotonic()
            if o.soak_s:
                elapsed = now - started
                if self.warm_attempted is None and elapsed >= o.soak_s * o.warmup_fraction:
                    self.warm_attempted = self.tally.attempted
                after_warmup = self.tally.attempted - (self.warm_attempted or 0)
                if elapsed >= o.soak_s * SOAK_STRETCH or (
                    elapsed >= o.soak_s and after_warmup >= o.soak_fetches
                ):
                    self.soak_elapsed = elapsed
                    break
            if not o.soak_s and self.tally.attempted >= self.budget:
                missing = [k for k in o.faults if not self.faults[k]]
                if (
                    (extended or (o.faults and not self.tally.delivered))
                    and not missing
                    and now - started <= o.every_fault_within_s
                ):
                    # The last kind has only just struck, or none of the fetches was
                    # served yet, and every fetch so far may have met the faults (a
                    # producer frozen before the sessions were up fails them all at
                    # once, and fast): the load goes on until a fetch is served after
                    # that, to show the system serving again after the faults, not
                    # only failing cleanly under them.
                    if delivered_at_last_kind is None:
                        delivered_at_last_kind = self.tally.delivered
                    recovering = self.tally.delivered <= delivered_at_last_kind
                else:
                    recovering = False
                short = self.tally.delivered < o.min_delivered
                if (recovering or short) and now - started <= o.every_fault_within_s:
                    self.budget += o.inflight_per_consumer
                elif not missing or now - started > o.every_fault_within_s:
                    for kind in missing:
                        self.tally.violations.append(f"fault kind {kind} never injected")
                    break
                else:
                    # Every kind runs at least once: more load, and the next fault now.
                    extended = True
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
                self.reap_crashes()
                self.sample(now - started)
                next_poll = now + o.sample_interval_s
            self.feed()
            self.collect(0.005)

    def _teardown(self) -> None:
        # Whatever went wrong, nothing is left running.
        for timer in self.resumes:
            timer.cancel()
        for c in [*filter(None, self.producers), *self.consumers, *self.retired]:
            if c.process.is_alive():
                c.kill()
        for proxy in self.proxies:
            proxy.close()
        if self.hosts is not None:
            self.hosts.close()


def run_chaos(options: ChaosOptions) -> ChaosReport:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="ecshare-chaos-") as tmp:
        return ChaosRun(options, Path(tmp)).run()
