"""What a chaos run holds while it runs: its processes, its fetches in flight and its tallies.

`RunState` builds that state; the parts of `ChaosRun` (`Fleet`, `Load`,
`SoakSampling`, `Verdict`) each work on it.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ecshare.apps.chaos.crashes import ConsumerEnd
from ecshare.apps.chaos.faultproxy import FaultProxy
from ecshare.apps.chaos.hosts import Host, Hosts
from ecshare.apps.chaos.messages import Outcome, PushEnded, ReadInFlight
from ecshare.apps.chaos.nodes import Child, working_set_keys
from ecshare.apps.chaos.options import TIMING, UCX_TRANSPORTS, ChaosOptions
from ecshare.config import Config
from ecshare.control import generate_keypair


@dataclass
class _Pending:
    fetch_id: int
    mm_hash: str
    nbytes: int
    consumer: Child
    bound_s: float  # deadline + grace


@dataclass
class _PendingPush:
    push_id: int
    mm_hash: str
    producer: Child
    to: str


@dataclass
class _PushTally:
    attempted: int = 0
    ended: Counter[str] = field(default_factory=Counter)  # "pushed", "refused: full", ...
    lost_with_producer: int = 0  # in flight in a producer that was SIGKILLed
    delivered_pushed: int = 0  # fetches whose entry a producer wrote (FetchResult.pushed)
    max_settle_s: float = 0.0


@dataclass
class _Tally:
    attempted: int = 0
    delivered: int = 0
    delivered_bytes: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    corrupted: int = 0
    untyped: int = 0
    vanished: int = 0
    late: int = 0
    max_overrun_s: float = -1e9
    lost_with_consumer: int = 0
    # 8 bytes a fetch: a soak records some 100 000 fetches a minute.
    settle_s: array[float] = field(default_factory=lambda: array("d"))
    violations: list[str] = field(default_factory=list)


class RunState:
    def __init__(self, options: ChaosOptions, workdir: Path) -> None:
        # Imported here, before anything starts, and not with the module: the rest of
        # the command line must work without the chaos extra.
        import psutil

        self._psutil = psutil
        self.o = options
        self.workdir = workdir
        self.seed = (
            options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
        )
        self.rng = random.Random(self.seed)
        self.keys = working_set_keys(options.working_set)
        self.large_keys = [k for k in self.keys if k[1] >= options.large_read_bytes] or self.keys
        producer_keys = generate_keypair(workdir, "producer")
        consumer_keys = generate_keypair(workdir, "consumer")
        every_node = {
            **TIMING,
            "ucx_tls": UCX_TRANSPORTS[options.ucx_tls],
            # A write after free (a read landing in blocks handed on) is counted.
            "store_canary": True,
        }
        if options.heartbeat_timeout_s:
            every_node["heartbeat_timeout_s"] = options.heartbeat_timeout_s
        self.producer_config = {
            **every_node,
            "region_bytes": options.producer_region_bytes,
            "server_secret_key_file": str(producer_keys.secret_path),
            "authorized_keys_file": str(consumer_keys.public_path),
        }
        self.consumer_config = {
            **every_node,
            "region_bytes": options.consumer_region_bytes,
            "client_secret_key_file": str(consumer_keys.secret_path),
            "server_public_key_file": str(producer_keys.public_path),
        }
        # Push: the producer key the consumers authenticate producers by may push too
        # (push_trusted_keys' default); each consumer takes pushes under a name of its own.
        self.config = Config.from_dict(self.consumer_config)
        # What children say unasked: fetch outcomes, and armed faults' reads in flight.
        self.events: queue.Queue[tuple[Child, Outcome | PushEnded | ReadInFlight]] = queue.Queue()
        self.pending: dict[int, _Pending] = {}
        self.tally = _Tally()
        self.pending_pushes: dict[int, _PendingPush] = {}
        self.pushes = _PushTally()
        self._push_ids = 0
        self.consumer_counters: dict[int, dict[str, int]] = {}  # pid -> last seen
        self.faults: Counter[str] = Counter()
        self.hangs = 0
        self.crashes = 0  # children that exited by themselves
        # Producers that died of the known UCX abort (`crashes.ucx_abort_evidence`), one
        # line each: when, which, and why it is that abort. Restarted, not crashes.
        self.known_ucx_aborts: list[str] = []
        self.consumer_ends: list[ConsumerEnd] = []  # every consumer a fault ended, for the above
        self.producers: list[Child | None] = [None] * options.producers
        self.ports: list[int] = [0] * options.producers
        self.proxies: list[FaultProxy] = []
        self.consumers: list[Child] = []
        self.retired: list[Child] = []  # replaced children, reaped at the end
        self.scheduled: list[tuple[float, str, Callable[[], None]]] = []
        self.resumes: list[threading.Timer] = []  # SIGCONTs due (see Fleet._resume_in)
        self.evictions: dict[int, tuple[int, int]] = {}  # producer pid -> (first, last) seen
        self._fetch_ids = 0
        self._deck: list[str] = []
        self.budget = options.fetches  # grows while some fault kind has not run yet
        self.probes: dict[int, Outcome | None] = {}  # fetch id -> outcome, after the faults
        self.recovery_pairs = 0
        self.load_started = 0.0
        # A soak's: fetches attempted when the warm-up ended, and the seconds it ran.
        self.warm_attempted: int | None = None
        self.soak_elapsed = 0.0
        self.producer_counters: dict[int, dict[str, int]] = {}  # pid -> last seen
        self.canary_violations: dict[int, int] = {}  # pid -> last seen, killed ones included
        self._consumer_ids = 0
        self._seed_ids = 0
        self.rss: dict[str, list[tuple[float, float, float]]] = {}  # name -> (t, rss, anon)
        self.usage: dict[str, list[tuple[float, float]]] = {}
        self.shrunk: set[int] = set()  # producers running under SHRUNK_LEASE
        # (proxy address, from, until) of each control partition, on the monotonic clock.
        self.partitions: list[tuple[str, float, float]] = []
        # With --netns (set up in `ChaosRun.run`): one host per producer slot, one per
        # live consumer.
        self.fault_log: list[str] = []  # what struck whom, when (seconds into the load)
        self.hosts: Hosts | None = None
        self.producer_hosts: list[Host] = []
        self.consumer_hosts: dict[int, Host] = {}  # consumer pid -> its host

    def clock(self) -> float:
        """Seconds since the load started: the fault log's clock."""
        return time.monotonic() - self.load_started if self.load_started else 0.0

    def log(self, what: str) -> None:
        """One line of the fault log: seconds since the load started, then `what`."""
        self.fault_log.append(f"{self.clock():8.3f} {what}")
