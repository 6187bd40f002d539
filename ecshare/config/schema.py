"""The `Config` Struct: every key an ecshare instance takes, and the rules across keys.

Each field's annotation is its whole specification: type, bounds and description, from which
fields.py derives the checks and reference.py docs/CONFIG.md. `Config.__post_init__` runs every
field check and every cross-field `_Rule` in `_RULES`, so an invalid `Config` cannot exist;
`from_dict`, `from_env` and `merged` decode into it through decode.py. Loading from all
sources at once is in sources.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from ecshare.config.decode import _build, _checked_keys, _values_from_env
from ecshare.config.errors import ConfigError, _show
from ecshare.config.fields import (
    ENV_PREFIX,
    GiB,
    KiB,
    MiB,
    TiB,
    Z85Key,
    _Field,
    struct_field_map,
    struct_fields,
)

Seconds = float
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME_ALLOWED = "1-64 of A-Z a-z 0-9 . _ -, not starting with . _ -"
# What a producer advertises (`Producer.address`): tcp://HOST:PORT.
Endpoint = Annotated[
    str,
    Meta(
        pattern=r"^tcp://[^\s/:]+(:[^\s/:]+)*:\d{1,5}$",
        extra={"allowed": "tcp://HOST:PORT, e.g. tcp://10.0.0.5:5701"},
    ),
]
# A consumer's push name, as `push_name` allows it.
PushName = Annotated[str, Meta(pattern=_NAME_PATTERN, extra={"allowed": _NAME_ALLOWED})]
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", "[::]"})


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything an ecshare instance can be told; the package docstring lists the sources."""

    # --- region -------------------------------------------------------------------------------
    region_bytes: Annotated[
        int,
        Meta(
            ge=MiB,
            le=TiB,
            extra={"size": True},
            description="Size of this instance's shared-memory region, which caches encoder "
            "outputs. The region also holds one 8-byte tag per block past that (0.012% more "
            "with 64 KiB blocks), which direct reads check, and 64 KiB where the tags this "
            "instance reads back from producers land.",
        ),
    ] = GiB
    block_bytes: Annotated[
        int,
        Meta(
            ge=4 * KiB,
            le=16 * MiB,
            extra={"power_of_two": True, "size": True},
            description="Allocation unit of the region; an entry occupies whole blocks.",
        ),
    ] = 64 * KiB
    prefault: Annotated[
        bool,
        Meta(
            description="Touch every page of the region at start-up, so that the first "
            "transfers do not pay for page faults (commits the memory up front)."
        ),
    ] = True
    region_hugepages: Annotated[
        bool,
        Meta(
            description="Ask for 2 MiB pages for the region. The host grants them only where "
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled is advise, within_size or "
            "always (often never by default); then a push's or a read's copy between two "
            "processes on one host pins the other's memory 2 MiB at a time, not 4 KiB. "
            "Elsewhere this changes nothing."
        ),
    ] = True

    # --- control plane ------------------------------------------------------------------------
    listen_host: Annotated[
        str,
        Meta(
            min_length=1,
            description="Address the control-plane server binds to. A wildcard (0.0.0.0, ::) "
            "accepts peers from other hosts and then needs advertise_host.",
        ),
    ] = "127.0.0.1"
    listen_port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="TCP port of the control-plane server. 0 picks a free port, and the "
            "port actually bound is the one advertised, so that several instances can share "
            "a host without coordination.",
        ),
    ] = 0
    advertise_host: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="Address peers use to reach this instance, put into "
            "ec_transfer_params. Unset means listen_host.",
        ),
    ] = None
    max_frame_bytes: Annotated[
        int,
        Meta(
            ge=4 * KiB,
            le=64 * MiB,
            extra={"size": True},
            description="Largest control-plane message accepted; larger ones are dropped "
            "and counted.",
        ),
    ] = MiB
    fetch_lane: Annotated[
        bool,
        Meta(
            description="Carry fetch requests, grants and releases of each session over a "
            "fast lane: a TCP port the producer opens beside its control port (on "
            "listen_host, lane_port) and offers, with its TLS certificate's digest and a "
            "fresh per-session key, inside the CURVE-encrypted handshake; each connection "
            "is TLS 1.3 with that certificate pinned, and binds to the session by the key. "
            "It saves about half of a control round trip. A producer with it off offers no "
            "lane, a consumer with it off takes none; either way, and whenever a lane "
            "cannot connect or closes, the session goes on over ZMQ. Turn it off where "
            "peers can reach only listen_port.",
        ),
    ] = True
    lane_port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="TCP port of the producer's fetch lane (fetch_lane), on listen_host. "
            "0 picks a free port; the port bound is the one offered to consumers. A port "
            "set here that cannot be bound (in use, say) fails the producer's start with "
            "an error naming it.",
        ),
    ] = 0
    events_port: Annotated[
        Annotated[int, Meta(ge=0, le=65535)] | None,
        Meta(
            description="TCP port (on listen_host) where this instance publishes its item "
            "events (an entry stored, an entry gone) for a proxy's item directory, under "
            "CURVE with this instance's server key (its client key on a consume-only "
            "instance); only admin_keys / admin_keys_file may subscribe. 0 picks a free "
            "port. Unset: no events.",
        ),
    ] = None
    direct_reads: Annotated[
        bool,
        Meta(
            description="Fetch without a round trip where possible. A producer with it on "
            "tells each consumer session that also has it on where every entry it commits "
            "lies, with the entry's tag (a word its store holds for the entry while its "
            "blocks are its own) and, for entries up to 1 MiB, its xxh3-64 digest; such a "
            "consumer then READs an announced entry at once, with no request and no grant, "
            "and keeps the bytes only if the digest matches (a lone small entry) or the tag "
            "read back after them is still in place (anything more; one READ for all of a "
            "batch). A stale place (the entry evicted and its blocks reused) or a failed READ "
            "falls back to a granted read from the same producer. The producer offers it "
            "only when its data plane serves reads without its own loop (NIXL's progress "
            "thread, or one host). Costs the producer a digest per small entry and one "
            "message per batch of commits to each such session.",
        ),
    ] = True
    tag_peek: Annotated[
        bool,
        Meta(
            description="Check a direct read's tag by reading the producer's memory "
            "(a pread of its /proc/<pid>/mem: 3 us, or 30 us after an idle gap, on a small "
            "host) rather than with a second NIXL READ (20 us, or 80 us after an idle gap), "
            "where the producer runs on "
            "this host (the same boot ID and PID namespace, told in its handshake) and its "
            "memory can be read from this process (the permission cross-memory attach needs "
            "too). Each entry over 256 KiB, and every entry of a fetch of more than 1 MiB in "
            "all, is then checked by its tag (a smaller one by its digest, cheaper there), "
            "and a caller that "
            "blocks on a fetch lends its thread from the session's first fetch. Anywhere "
            "else, or where the read "
            "fails, the tag is read back over NIXL as without it.",
        ),
    ] = True
    reply_spin_s: Annotated[
        Seconds,
        Meta(
            ge=0,
            le=0.1,
            description="How long a consumer's network thread, having sent a fetch "
            "request, waits awake for the answer (polling without blocking, with the "
            "shortest naps the OS gives, the GIL free during each) before it sleeps: at "
            "most this long after the request, and twice the typical answer's time once "
            "known; not at all where answers typically take longer. An answer that finds "
            "the thread awake saves waking it and running cold (0.1 to 0.3 ms per fetch "
            "after an idle gap on a small host), for about a quarter of a core while it "
            "waits. 0 turns it off.",
        ),
    ] = 0.001
    max_batch_items: Annotated[
        int,
        Meta(ge=1, le=65536, description="Most items in one batched request or grant."),
    ] = 256
    max_peer_links: Annotated[
        int,
        Meta(
            ge=1,
            le=65536,
            description="Most producers a consumer keeps a session with at once. A fetch "
            "that needs another one closes the least recently used idle link, or fails "
            "as peer_unreachable when every link is busy.",
        ),
    ] = 64
    peer_link_idle_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=86400,
            description="A consumer closes its session with a producer it has not fetched "
            "from for this long.",
        ),
    ] = 300.0
    max_sessions: Annotated[
        int,
        Meta(
            ge=1,
            le=65536,
            description="Most concurrent peer sessions a control-plane server keeps.",
        ),
    ] = 1024
    max_sessions_per_key: Annotated[
        Annotated[int, Meta(ge=1, le=65536)] | None,
        Meta(
            description="Most concurrent sessions one client key may hold, so that one key "
            "cannot take every session of max_sessions. Unset: no limit but max_sessions "
            "(consumers of one role often share a key; count their sessions when setting it).",
        ),
    ] = None
    max_grants_per_session: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 20,
            description="Most outstanding grants one session may hold; further requests are "
            "refused until some end.",
        ),
    ] = 4096
    max_pinned_bytes_per_session: Annotated[
        Annotated[int, Meta(ge=4 * KiB, le=TiB)] | None,
        Meta(
            extra={"size": True},
            description="Most bytes of entries one session may hold pinned at once; an item "
            "that would go over is refused as overloaded (retry once grants end), one larger "
            "than the limit as too large. Unset: no limit but the region, so one peer's "
            "outstanding grants can keep the whole region from being evicted.",
        ),
    ] = None

    # --- security -----------------------------------------------------------------------------
    insecure: Annotated[
        bool,
        Meta(
            description="Run the control plane over plain TCP, without CURVE authentication "
            "or encryption. Only for tests and trusted single-host setups; never implied.",
        ),
    ] = False
    server_secret_key_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="ZMQ certificate file (zmq.auth format) with the server's CURVE "
            "secret key; the serving side needs it unless insecure.",
        ),
    ] = None
    server_public_key_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="ZMQ certificate file with the server's CURVE public key, which "
            "clients use to authenticate the server.",
        ),
    ] = None
    client_secret_key_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="ZMQ certificate file with this instance's client CURVE secret key."),
    ] = None
    client_public_key_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="ZMQ certificate file with this instance's client CURVE public key."),
    ] = None
    authorized_keys_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="Allow-list of client CURVE public keys: a ZMQ certificate "
            "directory or a single certificate file.",
        ),
    ] = None
    server_public_key: Annotated[
        Z85Key | None,
        Meta(description="The server's CURVE public key inline, instead of a file."),
    ] = None
    authorized_keys: Annotated[
        tuple[Z85Key, ...],
        Meta(
            max_length=65536,
            description="Client CURVE public keys accepted inline, in addition to "
            "authorized_keys_file.",
        ),
    ] = ()
    admin_keys_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="Public keys (same formats as authorized_keys_file) that may query "
            "a producer's status (`ecshare status`), which lists every session. The "
            "producer's own key may always; admin keys open no fetch sessions unless "
            "also authorized.",
        ),
    ] = None
    admin_keys: Annotated[
        tuple[Z85Key, ...],
        Meta(
            max_length=65536,
            description="Admin public keys inline, in addition to admin_keys_file.",
        ),
    ] = ()

    # --- peers -----------------------------------------------------------------------------------
    trusted_producers: Annotated[
        tuple[Endpoint, ...],
        Meta(
            max_length=4096,
            description="Consumer: the only producer endpoints (tcp://HOST:PORT, as producers "
            "advertise them: advertise_host or listen_host, and listen_port) this instance "
            "fetches from; it also holds a session with each from start-up. A request whose "
            "ec_transfer_params name any other endpoint gets no fetch: the item is encoded "
            "locally and the refusal counted (peer_refused), so a request body cannot point "
            "the instance at an address of its choosing. Empty: any endpoint whose producer "
            "authenticates with the configured producer key (`ecshare launch` sets it to the "
            "encoders it starts).",
        ),
    ] = ()
    push_targets: Annotated[
        tuple[PushName, ...],
        Meta(
            max_length=4096,
            description="Producer: the consumer push names (their push_name) it may push to "
            'when a request asks (ec_transfer_params {"push_to": [...]}). Empty: any name '
            "that a consumer holding an authenticated session with it announced; a name no "
            "such session holds is never pushed to, whatever the list says (`ecshare launch` "
            "sets it to the prefill/decode instances' names).",
        ),
    ] = ()

    # --- push -----------------------------------------------------------------------------------
    push_name: Annotated[
        PushName | None,
        Meta(
            description="Consumer: accept pushes under this name (the name a producer's "
            "push names), from producers whose key push_trusted_keys allows. Unset: this "
            "instance accepts no push, and tells producers nothing of its memory.",
        ),
    ] = None
    push_trusted_keys: Annotated[
        tuple[Z85Key, ...],
        Meta(
            max_length=65536,
            description="Consumer: producer CURVE public keys allowed to push here. Empty: "
            "the producer key this consumer authenticates producers by (server_public_key "
            "or server_public_key_file).",
        ),
    ] = ()
    push_deadline_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="Consumer: longest it waits for a push's data once it has reserved "
            "blocks for it, plus fetch_deadline_per_gib_s per GiB; a push not done by then is "
            "given up (the item is pulled), its blocks held until the write has ended.",
        ),
    ] = 1.0
    push_credit_bytes: Annotated[
        int,
        Meta(
            ge=0,
            le=1 << 40,
            description="Consumer: blocks reserved ahead of time for each producer session "
            "that pushes here (a standing credit, at most a quarter of the region), so that a "
            "push of an item that fits is written with no offer round trip; a larger item, or "
            "one pushed while the credit is in use, is offered as usual. 0: no credit.",
        ),
    ] = 8 << 20
    push_wait_s: Annotated[
        Seconds,
        Meta(
            ge=0,
            le=60,
            description="Consumer: how long a fetch of an item announced as pushed waits for "
            "the producer's offer before it pulls the item instead.",
        ),
    ] = 0.05
    push_pin_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="Producer: the pin on an entry being pushed, renewed on every pass "
            "of its loop while the write may read it; it runs out only if that loop stops.",
        ),
    ] = 30.0
    max_pushes_in_flight: Annotated[
        int,
        Meta(
            ge=1,
            le=65536,
            description="Producer: most pushes offered or being written at once; further "
            "pushes are refused (the consumer pulls).",
        ),
    ] = 256

    # --- timeouts (seconds) -------------------------------------------------------------------
    handshake_timeout_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=300,
            description="Longest a peer may take to complete the control-plane handshake "
            "(authentication and region exchange) before it is dropped.",
        ),
    ] = 5.0
    request_timeout_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=300,
            description="Longest a client waits for the reply to one control-plane request.",
        ),
    ] = 2.0
    grant_lease_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="Producer: how long it keeps a grant's blocks pinned for its reader "
            "(told to the consumer in the handshake, renewed on request); after that the "
            "blocks may be reused.",
        ),
    ] = 30.0
    engine_pin_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="vLLM consumer: how long an entry found present for vLLM stays "
            "pinned until its load is planned, and then until the worker has copied it.",
        ),
    ] = 30.0
    save_report_timeout_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="vLLM producer: how long a planned save waits for its worker's "
            "report; a save not reported by then is given up and its blocks freed "
            "(save_abandoned).",
        ),
    ] = 30.0
    fetch_deadline_base_s: Annotated[
        Seconds,
        Meta(gt=0, le=3600, description="Fixed part of a consumer's per-item fetch deadline."),
    ] = 2.0
    fetch_deadline_per_gib_s: Annotated[
        Seconds,
        Meta(
            ge=0,
            le=3600,
            description="Seconds added to the per-item fetch deadline per GiB of item size.",
        ),
    ] = 10.0
    fetch_deadline_max_s: Annotated[
        Seconds,
        Meta(gt=0, le=3600, description="Cap on the per-item fetch deadline."),
    ] = 20.0
    heartbeat_interval_s: Annotated[
        Seconds,
        Meta(gt=0, le=60, description="Time between heartbeats on an idle session."),
    ] = 1.0
    heartbeat_timeout_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=600,
            description="A session silent for this long is closed and its grants released.",
        ),
    ] = 5.0
    retry_initial_backoff_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=60,
            description="Delay before the first retry of a failed request; it doubles on "
            "each further retry.",
        ),
    ] = 0.02
    retry_max_backoff_s: Annotated[
        Seconds,
        Meta(gt=0, le=600, description="Upper bound on the delay between retries."),
    ] = 1.0
    max_retries: Annotated[
        int,
        Meta(
            ge=0,
            le=100,
            description="Retries of a failed fetch before the item is encoded locally instead.",
        ),
    ] = 5
    quarantine_s: Annotated[
        Seconds,
        Meta(
            ge=0,
            le=3600,
            description="How long a peer that failed is skipped before it is tried again; "
            "0 disables quarantine.",
        ),
    ] = 10.0
    reap_interval_s: Annotated[
        Seconds,
        Meta(gt=0, le=60, description="How often expired leases and dead sessions are reaped."),
    ] = 0.5
    shutdown_timeout_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=600,
            description="Longest shutdown waits for in-flight transfers before releasing "
            "everything.",
        ),
    ] = 5.0

    # --- integrity ----------------------------------------------------------------------------
    checksum: Annotated[
        Literal["none", "xxh3_64"],
        Meta(
            description="Checksum the producer computes and the consumer verifies for every "
            "item. 'none' relies on the transport's own integrity checks (RDMA link CRC, "
            "or a copy within one host) and is safe there; over TCP between hosts use "
            "'xxh3_64', which also catches bookkeeping bugs, at the cost of one pass over "
            "the bytes on each side. A consumer set to 'xxh3_64' refuses items that carry "
            "no checksum.",
        ),
    ] = "none"
    store_canary: Annotated[
        bool,
        Meta(
            description="Debug: fill freed region blocks with a pattern and check it when they "
            "are handed out again, so that a write after free is counted (canary_violations) "
            "and logged. Costs a pass over the bytes on every free and allocation.",
        ),
    ] = False

    # --- data plane ---------------------------------------------------------------------------
    transport: Annotated[
        Literal["nixl"],
        Meta(description="Data-plane implementation used to read peers' regions."),
    ] = "nixl"
    nixl_backends: Annotated[
        tuple[Annotated[str, Meta(min_length=1)], ...],
        Meta(
            min_length=1,
            max_length=16,
            description="NIXL backend plugins to create, in order of preference.",
        ),
    ] = ("UCX",)
    nixl_progress_thread: Annotated[
        bool,
        Meta(
            description="Run NIXL's own progress thread on instances that serve reads "
            "(producers), asleep on the UCX worker's event fd until there is work, so that "
            "reads from them (over TCP they need the target's progress) move without "
            "ecshare's threads polling. Off: the producer's network thread polls the data "
            "plane every 0.2 ms while it has grants outstanding. Consumer-only instances "
            "never run it: they progress their own reads.",
        ),
    ] = True
    ucx_keepalive: Annotated[
        bool,
        Meta(
            description="Leave UCX's endpoint keepalive on. Off (the default) sets "
            "UCX_KEEPALIVE_INTERVAL=inf for the NIXL agent unless the environment sets it: "
            "with it on, once two instances transfer both ways (reads one way, pushes the "
            "other), each transfer that cross-memory attach ends inside the call waits "
            "instead for the other instance's thread to poll its data plane. A killed peer "
            "is found either way; a silent one by ecshare's heartbeats and deadlines.",
        ),
    ] = False
    ucx_tls: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="UCX transports for the NIXL agent (UCX_TLS), e.g. 'rc,sm,self'. "
            "Unset leaves the choice to UCX.",
        ),
    ] = None
    ucx_net_devices: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(
            description="Network devices UCX may use (UCX_NET_DEVICES), e.g. 'mlx5_0:1'. "
            "Unset leaves the choice to UCX.",
        ),
    ] = None

    # --- identity and metrics -----------------------------------------------------------------
    instance_name: Annotated[
        Annotated[str, Meta(pattern=_NAME_PATTERN, extra={"allowed": _NAME_ALLOWED})] | None,
        Meta(
            description="Name of this instance in NIXL agent names, logs and metrics. Unset "
            "means one is generated at start-up.",
        ),
    ] = None
    metrics_port: Annotated[
        Annotated[int, Meta(ge=1, le=65535)] | None,
        Meta(description="Port of the Prometheus metrics endpoint; unset disables it."),
    ] = None

    def __post_init__(self) -> None:
        for field in _fields():
            value = getattr(self, field.name)
            checked = field.check(value, field.name)
            if checked is not value:
                msgspec.structs.force_setattr(self, field.name, checked)
        for rule in _RULES:
            rule.enforce(self)

    def trusts(self, endpoint: str) -> bool:
        """Whether a consumer may fetch from `endpoint` (see `trusted_producers`)."""
        return not self.trusted_producers or endpoint in self.trusted_producers

    def may_push_to(self, name: str) -> bool:
        """Whether a producer may push to the consumer named `name` (see `push_targets`)."""
        return not self.push_targets or name in self.push_targets

    @property
    def advertised_host(self) -> str:
        """The host that peers are told to connect to."""
        return self.advertise_host if self.advertise_host is not None else self.listen_host

    def fetch_deadline_s(self, nbytes: int) -> float:
        """A consumer's deadline for fetching one item of `nbytes`: base + per GiB, capped.

        The cap is below `grant_lease_s` (checked at construction), so a consumer always gives up
        before the producer's lease on the blocks it reads can expire.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        scaled = self.fetch_deadline_base_s + self.fetch_deadline_per_gib_s * (nbytes / GiB)
        return min(self.fetch_deadline_max_s, scaled)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-compatible values; `Config.from_dict` reads it back."""
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in msgspec.structs.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Decode a dict such as vLLM's `ec_connector_extra_config`; unset keys keep defaults."""
        return _build(cls, _checked_keys(Config, data), {})

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, prefix: str = ENV_PREFIX
    ) -> Config:
        """Decode `ECSHARE_GRANT_LEASE_S=30`-style variables (`os.environ` if `environ` is None)."""
        values, sources = _values_from_env(
            Config, os.environ if environ is None else environ, prefix
        )
        return _build(cls, values, sources)

    def merged(self, overrides: Mapping[str, Any]) -> Config:
        """A copy with `overrides` (dict-style values) applied and validated again."""
        values = msgspec.structs.asdict(self)
        values.update(_checked_keys(Config, overrides))
        return _build(type(self), values, {})


# --- rules that involve more than one field ---------------------------------------------------


class _Rule(NamedTuple):
    key: str
    other: str
    expected: str
    why: str
    holds: Callable[[Config], bool]

    def enforce(self, config: Config) -> None:
        if self.holds(config):
            return
        detail = (
            f"got {_show(getattr(config, self.key))}, expected {self.expected} "
            f"({self.other} is {_show(getattr(config, self.other))})"
        )
        detail = f"{detail}: {self.why}" if self.why else detail
        raise ConfigError(self.key, detail, other=self.other)


_RULES: tuple[_Rule, ...] = (
    _Rule(
        "region_bytes",
        "block_bytes",
        "a multiple of block_bytes",
        "the region is divided into whole blocks",
        lambda c: c.region_bytes % c.block_bytes == 0,
    ),
    _Rule(
        "fetch_deadline_max_s",
        "grant_lease_s",
        "less than grant_lease_s",
        "the consumer's deadline must be shorter than the producer's lease, so that a reader "
        "always gives up before the producer may reuse the blocks it reads",
        lambda c: c.fetch_deadline_max_s < c.grant_lease_s,
    ),
    _Rule(
        "fetch_deadline_base_s",
        "fetch_deadline_max_s",
        "at most fetch_deadline_max_s",
        "the base deadline is the deadline of an empty item and cannot exceed the cap",
        lambda c: c.fetch_deadline_base_s <= c.fetch_deadline_max_s,
    ),
    _Rule(
        "heartbeat_timeout_s",
        "heartbeat_interval_s",
        "more than heartbeat_interval_s",
        "otherwise a healthy idle session would be closed between two heartbeats",
        lambda c: c.heartbeat_timeout_s > c.heartbeat_interval_s,
    ),
    _Rule(
        "retry_max_backoff_s",
        "retry_initial_backoff_s",
        "at least retry_initial_backoff_s",
        "",
        lambda c: c.retry_max_backoff_s >= c.retry_initial_backoff_s,
    ),
    _Rule(
        "advertise_host",
        "listen_host",
        "an address when listen_host is a wildcard",
        "peers cannot connect to a wildcard address",
        lambda c: c.advertise_host is not None or c.listen_host not in _WILDCARD_HOSTS,
    ),
    _Rule(
        "metrics_port",
        "listen_port",
        "a port other than listen_port",
        "",
        lambda c: c.metrics_port is None or c.metrics_port != c.listen_port,
    ),
    _Rule(
        "lane_port",
        "listen_port",
        "a port other than listen_port",
        "",
        lambda c: not c.lane_port or c.lane_port != c.listen_port,
    ),
    _Rule(
        "events_port",
        "listen_port",
        "a port other than listen_port",
        "",
        lambda c: not c.events_port or c.events_port != c.listen_port,
    ),
)


def _fields() -> tuple[_Field, ...]:
    """`Config`'s fields, in declaration order."""
    return struct_fields(Config)


def _field_map() -> dict[str, _Field]:
    """`Config`'s fields by name."""
    return struct_field_map(Config)
