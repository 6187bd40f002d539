"""What a chaos or soak run is asked to do, and the fixed settings its processes run under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ecshare.apps.bench.synthetic import parse_spec

MiB = 1 << 20
FINGERPRINT = "ecshare-chaos"
FAULT_KINDS = (
    "kill_producer",
    "kill_consumer",
    "pause_producer",
    "restart_producer",
    "cut_control",
    "delay_control",
    # Faults aimed at reads in flight: each waits until a read of at least
    # `large_read_bytes` is in flight at its target, then strikes (see fleet.py).
    "freeze_producer_mid_read",
    "freeze_consumer_mid_read",
    "readd_peer",
    "partition_control",
    "shrink_lease",
)
MID_READ_KINDS = (
    "freeze_producer_mid_read",
    "freeze_consumer_mid_read",
    "readd_peer",
    "partition_control",
)
# Faults aimed at push traffic (`push` > 0): each armed kind waits until a push of at
# least `large_read_bytes` is in flight at its target (a producer: offered or being
# written; a consumer: blocks reserved for it), then strikes (see fleet.py).
MID_PUSH_KINDS = (
    "kill_producer_mid_push",
    "kill_consumer_mid_push",
    "freeze_producer_mid_push",
    "freeze_consumer_mid_push",
    "cut_control_mid_push",
)
PUSH_KINDS = (*MID_PUSH_KINDS, "shrink_push_deadline", "fill_consumer_region")
ARMED_KINDS = (*MID_READ_KINDS, *MID_PUSH_KINDS)
# A consumer under `shrink_push_deadline` gives a push this long to land once it has
# reserved blocks: most pushes run late, are fenced, and are pulled meanwhile.
SHRUNK_PUSH_DEADLINE_S = 0.005
# The UCX transports a run can force NIXL onto, and the `ucx_tls` each one sets.
# cma leaves the choice to UCX, which on one host reads by cross-memory attach
# (synchronously, inside the read call); tcp makes every read asynchronous, moving
# only as the producer's progress loop runs.
UCX_TRANSPORTS: dict[str, str | None] = {"cma": None, "tcp": "tcp"}
# Short timeouts, so that every fault resolves within seconds; the consumer's
# deadline cap stays under the lease, as the config requires.
TIMING: dict[str, Any] = {
    "prefault": False,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "handshake_timeout_s": 1.0,
    "request_timeout_s": 1.0,
    "grant_lease_s": 3.0,
    "fetch_deadline_base_s": 2.0,
    "fetch_deadline_max_s": 2.5,
    "retry_initial_backoff_s": 0.01,
    "retry_max_backoff_s": 0.1,
    "quarantine_s": 0.5,
    "reap_interval_s": 0.1,
    "shutdown_timeout_s": 2.0,
    "ucx_net_devices": "lo",
}
# A producer under `shrink_lease` grants leases shorter than the consumers' own
# deadline cap (2.5 s): they must honour the lease on the wire (ItemReply.lease_ms).
# Its own deadlines only need to fit its config's rule (deadline cap < lease).
SHRUNK_LEASE: dict[str, Any] = {
    "grant_lease_s": 1.0,
    "fetch_deadline_base_s": 0.5,
    "fetch_deadline_max_s": 0.8,
}
_START_TIMEOUT_S = 60.0
_STATS_TIMEOUT_S = 10.0
SOAK_STRETCH = 4.0


@dataclass
class ChaosOptions:
    fetches: int = 2000
    soak_s: float = 0.0  # > 0: a soak of this many seconds instead of `fetches`
    # A soak runs on past soak_s (to at most SOAK_STRETCH times it) until this many
    # fetches were attempted after the warm-up: a leak per fetch is only seen over
    # enough fetches, and a slow host makes fewer in the same time.
    soak_fetches: int = 0
    producers: int = 2
    consumers: int = 3
    seed: int | None = None
    faults: tuple[str, ...] = FAULT_KINDS
    fault_interval_s: float = 1.5  # mean time between injected faults
    working_set: str = "64KiB:96,1MiB:24,4MiB:2"  # 38 MiB per producer
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
    netem: str = ""  # set by the netem wrapper: recorded in the report
    ucx_tls: str = "cma"  # a key of UCX_TRANSPORTS
    netns: bool = False  # each node in its own network namespace, joined by veth (needs tcp)
    large_read_bytes: int = 4 * MiB  # the mid-read faults wait for a read at least this large
    read_wait_s: float = 3.0  # how long such a fault waits for one before it is dealt again
    every_fault_within_s: float = 300.0  # run on past `fetches` until every kind has run
    # Run on past `fetches` (within every_fault_within_s) until this many were delivered:
    # fetches that fail fast while a link is down use up the budget in a moment, and a
    # run that served few shows little of the paths that serve.
    min_delivered: int = 0
    verbose: bool = False  # children log warnings (peer failures are expected here)
    # The share of fetch batches that come with a push: a producer pushes the items to
    # the consumer, which fetches them at the same time (announced as pushed or not)
    # or leaves them to later fetches. 0: no push, and consumers take none.
    push: float = 0.0
    # > 0: every node's heartbeat timeout instead of TIMING's. Longer than a producer
    # takes to restart, a consumer's session with a killed producer is not failed but
    # replaced: the new process on the same port answers NO_SESSION.
    heartbeat_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = [k for k in self.faults if k not in (*FAULT_KINDS, *PUSH_KINDS)]
        if unknown:
            raise ValueError(
                f"unknown fault kind {unknown[0]!r}: choose from "
                f"{', '.join((*FAULT_KINDS, *PUSH_KINDS))}"
            )
        if not 0.0 <= self.push <= 1.0:
            raise ValueError(f"push is a share of fetch batches, 0 to 1, got {self.push}")
        pushy = [k for k in self.faults if k in PUSH_KINDS]
        if pushy and not self.push:
            raise ValueError(
                f"fault kind {pushy[0]} strikes push traffic, and this run pushes nothing "
                "(--push SHARE)"
            )
        if self.heartbeat_timeout_s < 0:
            raise ValueError(f"heartbeat_timeout_s must be >= 0, got {self.heartbeat_timeout_s}")
        if self.ucx_tls not in UCX_TRANSPORTS:
            raise ValueError(
                f"ucx_tls must be one of {', '.join(UCX_TRANSPORTS)}, got {self.ucx_tls!r}"
            )
        mid_read = [k for k in self.faults if k in ARMED_KINDS]
        if mid_read and max(n for n, _ in parse_spec(self.working_set)) < self.large_read_bytes:
            raise ValueError(
                f"fault kind {mid_read[0]} waits for a transfer of at least "
                f"{self.large_read_bytes} bytes (--large-read), and the working set "
                f"{self.working_set!r} has no item that large"
            )
        if self.netns and self.ucx_tls != "tcp":
            raise ValueError(
                "netns (--netns) needs ucx_tls 'tcp' (--ucx-tls tcp): between namespaces of "
                "one host UCX would still read by cross-memory attach, and no byte of a read "
                "would cross the veth"
            )
