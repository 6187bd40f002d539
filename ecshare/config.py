"""The one typed configuration of an ecshare instance.

`Config` is the single source of truth: vLLM's `ec_connector_extra_config` (a dict), the
`ECSHARE_*` environment variables and the command line all decode into it, and the config
reference in README.md is generated from it (`python -m ecshare.config --write-readme README.md`).

Every check runs when a `Config` is constructed, so an invalid one cannot exist, and every
bad value raises one error type, `ConfigError`, whose message names the key, the value and
what is allowed.

Precedence, lowest first: defaults < environment < dict (`extra`) < command line. The dict is
the deployment's explicit per-connector setting, so it overrides ambient environment variables;
flags typed by a person override both.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

__all__ = [
    "ENV_PREFIX",
    "Config",
    "ConfigError",
    "FieldDoc",
    "add_config_arguments",
    "config_from_args",
    "describe_fields",
    "load_config",
    "render_reference_markdown",
    "update_readme_text",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

ENV_PREFIX = "ECSHARE_"
# ECSHARE_* variables that are not config keys and so are not rejected as unknown. None yet:
# add a name here, documented, before anything reads such a variable.
_ENV_ALLOWLIST: frozenset[str] = frozenset()

README_START = "<!-- config-reference:start -->"
README_END = "<!-- config-reference:end -->"

_Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_KEY_PATTERN = "^[" + re.escape(_Z85_ALPHABET) + "]{40}$"
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", "[::]"})


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key, the value and what is allowed."""

    def __init__(
        self,
        key: str | None,
        detail: str,
        *,
        source: str | None = None,
        other: str | None = None,
    ) -> None:
        self.key = key
        self.detail = detail
        self.source = source
        self.other = other  # the second key of a rule that involves two
        where = key if key is not None else "config"
        if source is not None:
            where = f"{where} (from {source})"
        super().__init__(f"{where}: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.key, self.detail, self.source, self.other))


def _rebuild_error(
    key: str | None, detail: str, source: str | None, other: str | None
) -> ConfigError:
    return ConfigError(key, detail, source=source, other=other)


# A CURVE public key as ZMQ writes it: 32 bytes in Z85, 40 characters.
Z85Key = Annotated[
    str,
    Meta(pattern=_Z85_KEY_PATTERN, extra={"z85": True, "allowed": "40-character Z85 string"}),
]
Seconds = float


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything an ecshare instance can be told; see the module docstring for the sources."""

    # --- region -------------------------------------------------------------------------------
    region_bytes: Annotated[
        int,
        Meta(
            ge=MiB,
            le=TiB,
            description="Size of this instance's shared-memory region, which caches encoder "
            "outputs.",
        ),
    ] = GiB
    block_bytes: Annotated[
        int,
        Meta(
            ge=4 * KiB,
            le=16 * MiB,
            extra={"power_of_two": True},
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
            description="Largest control-plane message accepted; larger ones are dropped "
            "and counted.",
        ),
    ] = MiB
    max_batch_items: Annotated[
        int,
        Meta(ge=1, le=65536, description="Most items in one batched request or grant."),
    ] = 256
    max_sessions: Annotated[
        int,
        Meta(
            ge=1,
            le=65536,
            description="Most concurrent peer sessions a control-plane server keeps.",
        ),
    ] = 1024
    max_grants_per_session: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 20,
            description="Most outstanding grants one session may hold; further requests are "
            "refused until some end.",
        ),
    ] = 4096

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
    lease_s: Annotated[
        Seconds,
        Meta(
            gt=0,
            le=3600,
            description="How long a producer keeps a grant's blocks pinned for its reader; "
            "after that the blocks may be reused.",
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
            "item. 'none' relies on the transport's own integrity checks (UCX, RDMA link "
            "CRC); 'xxh3_64' also catches bookkeeping bugs, at the cost of one pass over "
            "the bytes on each side.",
        ),
    ] = "none"

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
            description="Run NIXL's own progress thread. Off by default: it busy-spins a "
            "CPU core even when idle, and ecshare progresses transfers from its own thread.",
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
        Annotated[
            str,
            Meta(
                pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                extra={"allowed": "1-64 of A-Z a-z 0-9 . _ -, not starting with . _ -"},
            ),
        ]
        | None,
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

    @property
    def advertised_host(self) -> str:
        """The host that peers are told to connect to."""
        return self.advertise_host if self.advertise_host is not None else self.listen_host

    def fetch_deadline_s(self, nbytes: int) -> float:
        """A consumer's deadline for fetching one item of `nbytes`: base + per GiB, capped.

        The cap is below `lease_s` (checked at construction), so a consumer always gives up
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
        return _build(cls, _checked_keys(data), {})

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, prefix: str = ENV_PREFIX
    ) -> Config:
        """Decode `ECSHARE_LEASE_S=30`-style variables (`os.environ` when `environ` is None)."""
        values, sources = _values_from_env(os.environ if environ is None else environ, prefix)
        return _build(cls, values, sources)

    def merged(self, overrides: Mapping[str, Any]) -> Config:
        """A copy with `overrides` (dict-style values) applied and validated again."""
        values = msgspec.structs.asdict(self)
        values.update(_checked_keys(overrides))
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
        "lease_s",
        "less than lease_s",
        "the consumer's deadline must be shorter than the producer's lease, so that a reader "
        "always gives up before the producer may reuse the blocks it reads",
        lambda c: c.fetch_deadline_max_s < c.lease_s,
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
)


# --- field introspection and checks -----------------------------------------------------------


def _metas(tp: Any) -> tuple[Any, list[Meta]]:
    """Split `Annotated[T, Meta, ...]` (nested too) into T and its Metas."""
    metas: list[Meta] = []
    while typing.get_origin(tp) is Annotated:
        metas.extend(m for m in tp.__metadata__ if isinstance(m, Meta))
        tp = tp.__origin__
    return tp, metas


class _Constraints(NamedTuple):
    kind: Any  # int, float, bool, str, tuple or a Literal type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    extra: Mapping[str, Any] = {}
    item: _Constraints | None = None

    @classmethod
    def of(cls, tp: Any, metas: Sequence[Meta] = ()) -> _Constraints:
        tp, more = _metas(tp)
        metas = [*metas, *more]
        item = None
        if typing.get_origin(tp) is tuple:
            item = cls.of(typing.get_args(tp)[0])
            tp = tuple

        def first(attr: str) -> Any:
            return next((getattr(m, attr) for m in metas if getattr(m, attr) is not None), None)

        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra or {})
        return cls(
            kind=tp,
            ge=first("ge"),
            gt=first("gt"),
            le=first("le"),
            lt=first("lt"),
            min_length=first("min_length"),
            max_length=first("max_length"),
            pattern=first("pattern"),
            extra=extra,
            item=item,
        )

    def allowed(self) -> str:
        """What is allowed, in words; used in error messages and in the README."""
        if "allowed" in self.extra:
            return str(self.extra["allowed"])
        if typing.get_origin(self.kind) is Literal:
            return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(self.kind))
        if self.kind is bool:
            return "true or false"
        if self.kind is tuple:
            words = _length_words(self.min_length, self.max_length, "item") or "any number of items"
            each = self.item.allowed() if self.item is not None else "any string"
            return f"{words}, each {_with_article(each)}"
        if self.kind is str:
            if self.min_length == 1 and self.max_length is None:
                return "non-empty string"
            return _length_words(self.min_length, self.max_length, "character") or "any string"
        noun = "a power of two" if self.extra.get("power_of_two") else "an integer"
        if self.kind is float:
            noun = "a number"
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if self.ge is not None and self.le is not None:
            return f"{noun} between {_num(low)} and {_num(high)}"
        limits = []
        if low is not None:
            limits.append(f"{'at least' if self.ge is not None else 'more than'} {_num(low)}")
        if high is not None:
            limits.append(f"{'at most' if self.le is not None else 'less than'} {_num(high)}")
        return f"{noun} " + " and ".join(limits) if limits else noun

    def within(self, value: Any) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if isinstance(value, int | float) and not isinstance(value, bool):
            if self.ge is not None and value < self.ge:
                return False
            if self.gt is not None and value <= self.gt:
                return False
            if self.le is not None and value > self.le:
                return False
            if self.lt is not None and value >= self.lt:
                return False
            power_of_two = self.extra.get("power_of_two")
            if power_of_two and isinstance(value, int) and value & (value - 1):
                return False
        if isinstance(value, str | tuple):
            if self.min_length is not None and len(value) < self.min_length:
                return False
            if self.max_length is not None and len(value) > self.max_length:
                return False
        if isinstance(value, str):
            if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
                return False
            if self.extra.get("z85") and not _z85_decodes(value):
                return False
        return True


class _Field(NamedTuple):
    name: str
    default: Any
    optional: bool
    plain: Any  # the type without Meta or None, for msgspec's strict type check
    constraints: _Constraints
    description: str

    def check(self, value: Any, label: str) -> Any:
        """`value` converted to the field's type, or ConfigError naming `label`."""
        if value is None and self.optional:
            return None
        c = self.constraints
        if c.kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON writers emit 1e9 for big integers
        try:
            converted = msgspec.convert(value, self.plain, strict=True)
        except (msgspec.ValidationError, TypeError, ValueError, OverflowError):
            raise ConfigError(
                label, f"got {_show(value)} ({type(value).__name__}), expected {self.expected}"
            ) from None
        if not c.within(converted):
            raise ConfigError(label, f"got {_show(value)}, expected {c.allowed()}")
        if c.item is not None:
            for i, item in enumerate(converted):
                if not c.item.within(item):
                    raise ConfigError(
                        f"{label}[{i}]", f"got {_show(item)}, expected {c.item.allowed()}"
                    )
        return converted

    @property
    def expected(self) -> str:
        """The type in words, for type errors; a Literal lists its values."""
        kind = self.constraints.kind
        name = self.constraints.allowed() if typing.get_origin(kind) is Literal else self.type_name
        return f"{name} or None" if self.optional and not name.endswith("None") else name

    @property
    def type_name(self) -> str:
        kind = self.constraints.kind
        if typing.get_origin(kind) is Literal:
            name = " | ".join(json.dumps(a) for a in typing.get_args(kind))
        elif kind is tuple:
            name = "list[str]"
        else:
            name = kind.__name__
        return f"{name} | None" if self.optional else name

    @property
    def env_var(self) -> str:
        return _env_var(self.name)

    @property
    def flag(self) -> str:
        return _flag(self.name)


_TUPLE: Any = tuple  # subscripted with a runtime item type below


@functools.cache
def _fields() -> tuple[_Field, ...]:
    result = []
    for info in msgspec.structs.fields(Config):
        outer, metas = _metas(info.type)
        members = typing.get_args(outer) if _is_union(outer) else (outer,)
        non_null = [m for m in members if m is not type(None)]
        (inner,) = non_null
        description = next((m.description for m in metas if m.description), "")
        stripped, _ = _metas(inner)
        if typing.get_origin(stripped) is tuple:
            item, _ = _metas(typing.get_args(stripped)[0])
            stripped = _TUPLE[item, ...]
        result.append(
            _Field(
                name=info.name,
                default=info.default,
                optional=len(non_null) < len(members),
                plain=stripped,
                constraints=_Constraints.of(inner, metas),
                description=description,
            )
        )
    return tuple(result)


@functools.cache
def _field_map() -> dict[str, _Field]:
    return {f.name: f for f in _fields()}


def _env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _z85_decodes(text: str) -> bool:
    """Whether every 5-character group encodes a 32-bit word (85**5 exceeds 2**32)."""
    for start in range(0, len(text), 5):
        word = 0
        for ch in text[start : start + 5]:
            word = word * 85 + _Z85_ALPHABET.index(ch)
        if word > 0xFFFFFFFF:
            return False
    return True


def _length_words(low: int | None, high: int | None, unit: str) -> str:
    if low is not None and low == high:
        return f"exactly {low} {unit}s"
    if low and high is not None:
        return f"{low} to {high} {unit}s"
    if low:
        return f"at least {low} {unit}{'s' if low > 1 else ''}"
    if high is not None:
        return f"at most {high} {unit}s"
    return ""


def _with_article(words: str) -> str:
    if words.startswith(("a ", "an ", "any ", "one ")):
        return words
    return ("an " if words[0] in "aeiou" else "a ") + words


def _num(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- loading: dict, environment, command line -------------------------------------------------


def _checked_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(None, f"got {_show(data)} ({type(data).__name__}), expected a mapping")
    known = _field_map()
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(None, f"got key {_show(key)} ({type(key).__name__}), expected str")
        if key not in known:
            label = key if key.isidentifier() else repr(key)
            raise ConfigError(label, "unknown key" + _did_you_mean(key, list(known)))
    return dict(data)


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return "; the config reference in README.md lists every key"


def _build(cls: type[Config], values: Mapping[str, Any], sources: Mapping[str, str]) -> Config:
    try:
        return cls(**values)
    except ConfigError as e:
        key = e.key.split("[", 1)[0] if e.key else None
        source = sources.get(key) if key is not None else None
        detail = e.detail
        if e.other is not None and e.other in sources:
            detail += f" ({e.other} was set by {sources[e.other]})"
        if source is None and detail == e.detail:
            raise
        raise ConfigError(e.key, detail, source=source, other=e.other) from None


_BOOL_WORDS = {
    "1": True,
    "0": False,
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
}


def _parse_text(field: _Field, text: str, label: str, source: str) -> Any:
    """A string from the environment or the command line, parsed for `field`."""
    raw = text.strip()
    kind = field.constraints.kind
    if field.optional and raw.lower() in ("", "none"):
        return None
    try:
        if kind is bool:
            return _BOOL_WORDS[raw.lower()]
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is tuple:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
    except (KeyError, ValueError):
        expected = "one of " + ", ".join(_BOOL_WORDS) if kind is bool else kind.__name__
        raise ConfigError(label, f"got {_show(text)}, expected {expected}", source=source) from None
    return raw


def _values_from_env(
    environ: Mapping[str, str], prefix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    fields = _field_map()
    by_var = {prefix + name.upper(): f for name, f in fields.items()}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(prefix) or var[len(prefix) :] in _ENV_ALLOWLIST:
            continue
        field = by_var.get(var)
        if field is None:
            hint = _did_you_mean(var.upper(), list(by_var))
            raise ConfigError(var, "unknown environment variable" + hint)
        values[field.name] = _parse_text(field, environ[var], field.name, var)
        sources[field.name] = var
    return values, sources


def load_config(
    *,
    extra: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cli: argparse.Namespace | None = None,
    prefix: str = ENV_PREFIX,
) -> Config:
    """Layer defaults < environment < `extra` dict < command line into one Config.

    `env=None` reads `os.environ`; pass `{}` to ignore the environment. `cli` is a namespace
    from a parser that `add_config_arguments` extended; only flags the user gave count.
    """
    values, sources = _values_from_env(os.environ if env is None else env, prefix)
    if extra is not None:
        for key, value in _checked_keys(extra).items():
            values[key] = value
            sources[key] = "extra config"
    if cli is not None:
        fields = _field_map()
        for key, value in config_from_args(cli).items():
            values[key] = value
            sources[key] = fields[key].flag
    return _build(Config, values, sources)


def add_config_arguments(
    parser: argparse.ArgumentParser, *, title: str = "ecshare configuration"
) -> argparse._ArgumentGroup:
    """Add one `--lease-s` style flag per Config field; booleans get `--no-...` too.

    Flags default to "not given" (argparse.SUPPRESS) so that `config_from_args` can tell a
    value the user typed from a default.
    """
    group = parser.add_argument_group(title)
    for field in _fields():
        default = _render_default(field).replace("`", "")
        help_text = f"{field.description} [default: {default}; env: {field.env_var}]"
        help_text = help_text.replace("%", "%%")
        if field.constraints.kind is bool:
            group.add_argument(
                field.flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        group.add_argument(
            field.flag,
            dest=field.name,
            type=_argument_type(field),
            default=argparse.SUPPRESS,
            metavar=_metavar(field),
            help=help_text,
        )
    return group


def _argument_type(field: _Field) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return field.check(_parse_text(field, text, field.name, field.flag), field.name)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.detail) from None

    return parse


def _metavar(field: _Field) -> str:
    kind = field.constraints.kind
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(kind)) + "}"
    for suffix, metavar in (("_s", "SECONDS"), ("_bytes", "BYTES"), ("_file", "PATH")):
        if field.name.endswith(suffix):
            return metavar
    if kind is tuple:
        return "A,B,..."
    return "N" if kind is int else field.name.rsplit("_", 1)[-1].upper()


def config_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The config values among `namespace`'s attributes: only the flags the user gave."""
    given = vars(namespace)
    return {f.name: given[f.name] for f in _fields() if f.name in given}


# --- documentation ----------------------------------------------------------------------------


class FieldDoc(NamedTuple):
    """One row of the config reference."""

    name: str
    type: str
    default: Any
    allowed: str
    description: str

    @property
    def env_var(self) -> str:
        return _env_var(self.name)

    @property
    def flag(self) -> str:
        return _flag(self.name)


def describe_fields() -> list[FieldDoc]:
    """Name, type, default, what is allowed and description of every field, in order."""
    return [
        FieldDoc(f.name, f.type_name, f.default, _allowed_with_rules(f), f.description)
        for f in _fields()
    ]


def _allowed_with_rules(field: _Field) -> str:
    allowed = field.constraints.allowed()
    rules = [r.expected for r in _RULES if r.key == field.name]
    return "; ".join([allowed, *rules])


def _render_default(field: _Field) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`" + ",".join(value) + "`" if value else "empty"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int) and field.name.endswith("_bytes"):
        for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if value >= size and value % size == 0:
                return f"`{value}` ({value // size} {unit})"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference_markdown() -> str:
    """The README's config reference, generated from `Config`."""
    lines = [
        "## Configuration reference",
        "",
        "Generated from `ecshare.config.Config` by `make config-doc`; do not edit by hand.",
        "",
        "Every key can be given in vLLM's `ec_connector_extra_config` (as the key), as an",
        "environment variable or as a command-line flag. Precedence, lowest first: defaults <",
        "environment < `ec_connector_extra_config` < command line. Environment and flag values",
        "are strings: booleans take `1/0/true/false/yes/no/on/off`, lists are comma-separated,",
        "and `none` or an empty string unsets an optional key. An unknown `ECSHARE_*` variable",
        "is an error. Sizes are in bytes and times in seconds.",
        "",
        "| Key | Env var | CLI flag | Type | Default | Allowed | Description |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    flags = {f.name: f for f in _fields()}
    for doc in describe_fields():
        field = flags[doc.name]
        flag = f"`{doc.flag}`"
        if field.constraints.kind is bool:
            flag = f"`{doc.flag}`, `--no-{doc.flag[2:]}`"
        cells = [
            f"`{doc.name}`",
            f"`{doc.env_var}`",
            flag,
            f"`{doc.type}`",
            _render_default(field),
            doc.allowed,
            doc.description,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "Rules across keys, checked whenever a config is built:", ""]
    for rule in _RULES:
        why = f": {rule.why}" if rule.why else ""
        lines.append(f"- `{rule.key}` must be {rule.expected}{why}.")
    return "\n".join(lines) + "\n"


def update_readme_text(text: str) -> str:
    """`text` with the generated section between the markers (appended if they are absent)."""
    block = f"{README_START}\n{render_reference_markdown()}{README_END}"
    start = text.find(README_START)
    end = text.find(README_END, start + 1) if start >= 0 else -1
    if start >= 0 and end >= 0:
        return text[:start] + block + text[end + len(README_END) :]
    separator = (
        "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    )
    return f"{text}{separator}{block}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecshare.config", description="Print or check the config reference."
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write-readme", metavar="PATH", type=Path, help="update PATH in place")
    action.add_argument("--check", metavar="PATH", type=Path, help="exit 1 if PATH is stale")
    args = parser.parse_args(argv)
    if args.write_readme is not None:
        path: Path = args.write_readme
        old = path.read_text(encoding="utf-8") if path.exists() else "# ecshare\n"
        new = update_readme_text(old)
        if new != old:
            path.write_text(new, encoding="utf-8")
        return 0
    if args.check is not None:
        text = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
        if update_readme_text(text) != text:
            print(
                f"{args.check}: config reference is stale; run "
                f"`python -m ecshare.config --write-readme {args.check}`",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(render_reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
