"""What a chaos or soak run is asked to do, and the fixed settings its processes run under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
