"""The proxy's one typed configuration, and the `ecshare proxy` flags that decode into it.

`ProxyConfig` is checked when it is constructed, so an invalid one cannot exist; every bad
value raises `ConfigError`, whose message names the flag and what is allowed. The API keys
come from `--api-key-file` (one key, or keys each with its tenant: `tenants`) or, failing
that, the `ECSHARE_PROXY_API_KEY` environment variable (allow-listed in
`ecshare.config.decode`, so an instance's `load_config` does not reject it as an unknown
`ECSHARE_*` variable). They never appear in a repr.

This module imports no HTTP stack: the CLI builds its parser from it cheaply.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ecshare.apps.proxy.tenants import DEFAULT_TENANT, check_tenants, read_key_file
from ecshare.config import ConfigError
from ecshare.config.fields import parse_size
from ecshare.config.secret_files import check_secret_file, read_secret_file

API_KEY_ENV = "ECSHARE_PROXY_API_KEY"
MiB = 1 << 20
MAX_WORKERS = 256
DEFAULT_MAX_BODY_BYTES = 64 * MiB
# A prefill/decode instance's push name, as ecshare's `push_name` allows it.
_PUSH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# What a prefill/decode instance gets of a request's media once the encoders have answered.
PD_MEDIA = ("omit", "keep")
# What becomes of a client's uuid on a media part (ecshare.apps.proxy.parts).
UUID_MODES = ("refuse", "strip", "tenant")
# How the proxy routes requests with media (ecshare.apps.proxy.routing).
ROUTINGS = ("reuse", "load")
# The modalities vLLM's `--limit-mm-per-prompt` names.
MODALITIES = ("image", "audio", "video")


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the proxy listens, which backends it uses, and its limits and timeouts."""

    encoders: tuple[str, ...] = ()
    prefill_decode: tuple[str, ...]
    # Each prefill/decode instance's push name (`--pd URL=PUSH_NAME`), in the order of
    # `prefill_decode`, "" for one that takes no push; empty: none does. The encoders are
    # asked to push a request's items to the instance chosen for it.
    pd_push_names: tuple[str, ...] = ()
    # Decode instances (`--decode URL`): where set, `prefill_decode` holds prefill instances
    # (`--prefill URL[=PUSH_NAME]`), and each request is prefilled on one of them and
    # decoded on one of these, its KV passed by vLLM's KV connector (`handoff`).
    decode: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    # One key, of the tenant "default" (`ECSHARE_PROXY_API_KEY`, or a file of one bare key).
    api_key: str | None = None
    # Keys, each to its tenant (`--api-key-file`, `tenants`); with `api_key`, both are taken.
    api_keys: dict[str, str] = {}
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Media items per encoder call: 1 sends each item alone, as vLLM's EPD examples do.
    encoder_batch_size: int = 1
    # Whole encoder call; past it the items are left to prefill/decode to encode locally.
    encoder_timeout_s: float = 60.0
    # Longest silence from a prefill/decode instance: before its headers, and between
    # streamed chunks. A non-streaming answer arrives whole, so this bounds its generation.
    pd_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    # Consecutive failed calls (timeouts, 5xx) that eject a backend before its next health
    # check; a refused connection ejects at once.
    eject_after_failures: int = 3
    access_log: bool = False
    # Proxy processes sharing the port (SO_REUSEPORT), each with its own event loop.
    workers: int = 1
    # `ec_transfer_params` a client wrote into its request body name the producers a
    # prefill/decode instance fetches from: dropped (and counted) unless the operator
    # trusts every client with that.
    pass_ec_transfer_params: bool = False
    # Each routed answer's `x-ecshare-route` and `Server-Timing` headers (`routing`): they
    # name the prefill/decode instance and tell a caller whether its media was held
    # already, which another tenant may have sent, so they are for trusted callers only.
    route_headers: bool = False
    # "omit": each media item whose params carry its placeholder metadata reaches
    # prefill/decode as that metadata only (no download, decode or processing there);
    # "keep": the request goes with its media as the client sent it.
    pd_media: str = "omit"
    # What becomes of a client's `uuid` on a media part: "refuse" (400), "strip", or
    # "tenant" (scoped to the client's tenant; `parts`, `tenants`).
    client_uuids: str = "refuse"
    max_uuid_chars: int = 256
    # Client `*_embeds` parts: refused unless every client is trusted with them.
    allow_client_embeds: bool = False
    # No cache entry shared between tenants: each tenant's media keyed apart (`tenants`).
    tenant_isolation: bool = False
    # Media items per request and modality, as vLLM's flag of that name (999 where unnamed).
    limit_mm_per_prompt: dict[str, int] = {}
    # Encoder calls one request may make (its items are batched to fit), and in flight at
    # once over all requests (more wait their turn).
    max_encoder_calls: int = 8
    max_encoder_in_flight: int = 64
    # Of those, at most this many per encoder in rotation: what an encoder cannot start at
    # once queues inside it, first come first served, where a tenant's turn means nothing.
    max_in_flight_per_encoder: int = 8
    # Requests one tenant may have in flight; more are refused (429).
    max_tenant_in_flight: int = 256
    # Open client connections (per proxy process); more are answered 503 and closed.
    max_connections: int = 1024
    # Open connections of one client address (per proxy process); 0: an eighth of
    # max_connections.
    max_connections_per_address: int = 0
    # Connections that have not yet shown a key and sent a whole request body: their own
    # pool inside max_connections, so that they never take an authenticated tenant's
    # connection (`edge`); 0: a quarter of max_connections.
    max_preauth_connections: int = 0
    # A new connection's first byte, and its whole request header, must arrive within these.
    first_byte_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    # An idle connection between two requests is closed after this long.
    keepalive_timeout_s: float = 30.0
    # Longest time a request body may take to arrive.
    body_timeout_s: float = 30.0
    # Encoder calls in flight for one tenant, of the encoder slots (the smaller of
    # max_encoder_in_flight and max_in_flight_per_encoder per encoder), and the longest a
    # request waits for an encoder slot before it is refused (429, `fanout`); 0: half of
    # the slots.
    max_tenant_encoder_in_flight: int = 0
    encoder_slot_wait_s: float = 10.0
    # Requests in flight to each prefill/decode instance in rotation; more wait in the
    # proxy, a tenant holding at most half of them, and are refused (429) past the wait.
    # 0: no bound (an instance batches what it is sent, and queues the rest inside it,
    # first come first served). Bounded to what an instance runs at the latency it is
    # meant to keep, no tenant's burst can add more than that to another's wait.
    max_in_flight_per_pd: int = 0
    pd_slot_wait_s: float = 30.0
    # Inline media bounded by what it decodes to, read from its header before any encoder
    # call (`bounds`): pixels of an image or of one video frame, frames of a video,
    # seconds of audio.
    max_image_pixels: int = 33_554_432
    max_video_frames: int = 18_000
    max_audio_seconds: float = 600.0
    # The secret under which tenant salts are keyed (`tenants.tenant_salt`); with tenant
    # isolation and none given, the proxy makes one at start, one for all its workers.
    tenant_secret: str | None = None
    # Membership and the item directory (`discovery`, `directory`, `feeds`).
    events_port: int | None = None  # where every instance publishes its item events
    events_key_file: str | None = None  # the proxy's CURVE secret key for the feeds
    events_encoder_key: str | None = None  # the key encoders publish under (Z85 or file)
    events_pd_key: str | None = None  # prefill/decode's; unset: events_encoder_key
    events_timeout_s: float = 5.0  # a feed silent this long is forgotten
    directory_max_items: int = 1_000_000
    admin_key: str | None = None  # for /v1/members; unset: no registration endpoint
    discover_encoders: str | None = None  # NAME:PORT, resolved every discover_interval_s
    discover_pd: str | None = None
    discover_decode: str | None = None  # decode instances (with --prefill)
    discover_interval_s: float = 10.0
    # "reuse": held items skip the encoders, prefill/decode chosen by the items it holds
    # against its load, one encode per new content (`routing`); "load": every media part
    # to an encoder and prefill/decode by load, as vLLM's example EPD proxy.
    routing: str = "reuse"
    # Seconds an http/https media URL is trusted to name the same content; 0: never, it
    # is encoded every time (`identity`).
    url_ttl_s: float = 0.0
    # Content keys remembered with the items their encoders reported (least recently used
    # out first).
    route_cache_items: int = 65536
    # What one request in flight on a prefill/decode instance weighs against one of the
    # request's items already in its region (`routing`).
    route_load_weight: float = 1.0

    @property
    def split(self) -> bool:
        """Whether requests are prefilled and decoded on separate instances (`handoff`)."""
        return bool(self.decode) or self.discover_decode is not None

    def __post_init__(self) -> None:
        for name, whole, share in (
            ("max_connections_per_address", self.max_connections, 8),
            ("max_preauth_connections", self.max_connections, 4),
        ):
            if not getattr(self, name):
                msgspec.structs.force_setattr(self, name, max(1, whole // share))
        if not self.prefill_decode and self.discover_pd is None and self.admin_key is None:
            raise ConfigError(
                "--pd",
                "at least one prefill/decode URL is required (or --discover-pd, "
                "or --admin-key-file to register them)",
            )
        pd_flag = "--prefill" if self.split else "--pd"
        if self.split and not self.prefill_decode and self.discover_pd is None:
            raise ConfigError("--decode", "decode instances need at least one --prefill URL")
        for flag, urls in (
            ("--encoder", self.encoders),
            (pd_flag, self.prefill_decode),
            ("--decode", self.decode),
        ):
            for url in urls:
                _check_url(flag, url)
            if len(set(urls)) != len(urls):
                raise ConfigError(flag, f"got a URL twice in {list(urls)}")
        if self.pd_push_names:
            if len(self.pd_push_names) != len(self.prefill_decode):
                raise ConfigError(pd_flag, "one push name (or none) per prefill/decode URL")
            for name in self.pd_push_names:
                if name and not _PUSH_NAME.fullmatch(name):
                    raise ConfigError(
                        pd_flag,
                        f"got push name {name!r}, expected 1-64 of A-Z a-z 0-9 . _ -, "
                        "not starting with . _ -",
                    )
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"got {self.port}, expected 0..65535")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key-file", "the API key is empty")
        check_tenants(self.api_keys)
        if self.api_key is not None and self.api_key in self.api_keys:
            raise ConfigError("--api-key-file", "a key given twice")
        if self.client_uuids not in UUID_MODES:
            raise ConfigError(
                "--client-uuids", f"got {self.client_uuids!r}, expected one of {UUID_MODES}"
            )
        if not 1 <= self.max_uuid_chars <= 4096:
            raise ConfigError("--max-uuid-chars", f"got {self.max_uuid_chars}, expected 1..4096")
        for modality, limit in self.limit_mm_per_prompt.items():
            if modality not in MODALITIES or not isinstance(limit, int) or limit < 0:
                raise ConfigError(
                    "--limit-mm-per-prompt",
                    f"got {modality!r}: {limit!r}, expected image, audio or video to a count >= 0",
                )
        for flag, count in (
            ("--max-encoder-calls", self.max_encoder_calls),
            ("--max-encoder-in-flight", self.max_encoder_in_flight),
            ("--max-in-flight-per-encoder", self.max_in_flight_per_encoder),
            ("--max-tenant-in-flight", self.max_tenant_in_flight),
            ("--max-connections", self.max_connections),
            ("--max-connections-per-address", self.max_connections_per_address),
            ("--max-preauth-connections", self.max_preauth_connections),
            ("--max-image-pixels", self.max_image_pixels),
            ("--max-video-frames", self.max_video_frames),
        ):
            if count < 1:
                raise ConfigError(flag, f"got {count}, expected >= 1")
        if self.max_in_flight_per_pd < 0:
            raise ConfigError(
                "--max-in-flight-per-pd",
                f"got {self.max_in_flight_per_pd}, expected >= 1 (or 0: no bound)",
            )
        if self.max_tenant_encoder_in_flight < 0:
            raise ConfigError(
                "--max-tenant-encoder-in-flight",
                f"got {self.max_tenant_encoder_in_flight}, expected >= 1 (or 0: half the slots)",
            )
        for flag, part, whole, whole_flag in (
            (
                "--max-connections-per-address",
                self.max_connections_per_address,
                self.max_connections,
                "--max-connections",
            ),
            (
                "--max-preauth-connections",
                self.max_preauth_connections,
                self.max_connections,
                "--max-connections",
            ),
            (
                "--max-tenant-encoder-in-flight",
                self.max_tenant_encoder_in_flight,
                self.max_encoder_in_flight,
                "--max-encoder-in-flight",
            ),
        ):
            if part > whole:
                raise ConfigError(flag, f"got {part}, expected at most {whole_flag} ({whole})")
        if self.tenant_secret is not None and len(self.tenant_secret) < 32:
            raise ConfigError(
                "--tenant-secret-file",
                "the tenant secret is shorter than 32 characters (make one with: "
                "python -c 'import secrets; print(secrets.token_hex(32))')",
            )
        if self.max_body_bytes < 1024:
            raise ConfigError("--max-body", f"got {self.max_body_bytes} bytes, expected >= 1 KiB")
        if self.encoder_batch_size < 1:
            raise ConfigError("--encoder-batch", f"got {self.encoder_batch_size}, expected >= 1")
        if self.eject_after_failures < 1:
            raise ConfigError("--eject-after", f"got {self.eject_after_failures}, expected >= 1")
        if self.pd_media not in PD_MEDIA:
            raise ConfigError("--pd-media", f"got {self.pd_media!r}, expected one of {PD_MEDIA}")
        if self.routing not in ROUTINGS:
            raise ConfigError("--routing", f"got {self.routing!r}, expected one of {ROUTINGS}")
        if not (math.isfinite(self.url_ttl_s) and self.url_ttl_s >= 0):
            raise ConfigError("--url-ttl", f"got {self.url_ttl_s!r}, expected seconds >= 0")
        if self.route_cache_items < 1:
            raise ConfigError("--route-cache-items", f"got {self.route_cache_items}, expected >= 1")
        if not (math.isfinite(self.route_load_weight) and self.route_load_weight >= 0):
            raise ConfigError(
                "--route-load-weight", f"got {self.route_load_weight!r}, expected a number >= 0"
            )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError("--workers", f"got {self.workers}, expected 1..{MAX_WORKERS}")
        for flag, value in (
            ("--encoder-timeout", self.encoder_timeout_s),
            ("--pd-timeout", self.pd_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
            ("--health-interval", self.health_interval_s),
            ("--health-timeout", self.health_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--first-byte-timeout", self.first_byte_timeout_s),
            ("--header-timeout", self.header_timeout_s),
            ("--keepalive-timeout", self.keepalive_timeout_s),
            ("--encoder-slot-wait", self.encoder_slot_wait_s),
            ("--pd-slot-wait", self.pd_slot_wait_s),
            ("--max-audio-seconds", self.max_audio_seconds),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(flag, f"got {value!r}, expected a positive number of seconds")
        _check_membership(self)

    def keys(self) -> dict[str, str]:
        """Every API key, each to its tenant; empty when no key is asked."""
        keys = dict(self.api_keys)
        if self.api_key is not None:
            keys[self.api_key] = DEFAULT_TENANT
        return keys

    def __repr__(self) -> str:
        secret = ("api_key", "api_keys", "admin_key", "tenant_secret")
        shown: dict[str, Any] = {
            f: getattr(self, f) for f in self.__struct_fields__ if f not in secret
        }
        shown["api_key"] = None if self.api_key is None else "<hidden>"
        shown["admin_key"] = None if self.admin_key is None else "<hidden>"
        shown["api_keys"] = f"<{len(self.api_keys)} hidden>"
        shown["tenant_secret"] = None if self.tenant_secret is None else "<hidden>"
        return "ProxyConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def _check_url(flag: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(flag, f"got {url!r}, expected a base URL such as http://host:8000")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(flag, f"got {url!r}, expected a base URL without a path")


def _check_membership(c: ProxyConfig) -> None:
    if c.events_port is not None:
        if not 1 <= c.events_port <= 65535:
            raise ConfigError("--events-port", f"got {c.events_port}, expected 1..65535")
        if c.events_key_file is None or c.events_encoder_key is None:
            raise ConfigError(
                "--events-port",
                "the item feeds are CURVE-authenticated: give --events-key (the proxy's "
                "secret key file) and --events-encoder-key (the key instances publish under)",
            )
    if not (math.isfinite(c.events_timeout_s) and c.events_timeout_s > 0):
        raise ConfigError("--events-timeout", f"got {c.events_timeout_s!r}, expected > 0 s")
    if not (math.isfinite(c.discover_interval_s) and c.discover_interval_s > 0):
        raise ConfigError("--discover-interval", f"got {c.discover_interval_s!r}, expected > 0")
    if c.directory_max_items < 1:
        raise ConfigError("--directory-max-items", f"got {c.directory_max_items}, expected >= 1")
    if c.admin_key is not None and len(c.admin_key.strip()) < 16:
        raise ConfigError("--admin-key-file", "the admin key is shorter than 16 characters")
    for flag, target in (
        ("--discover-encoders", c.discover_encoders),
        ("--discover-pd", c.discover_pd),
        ("--discover-decode", c.discover_decode),
    ):
        if target is not None:
            split_target(flag, target)


def split_target(flag: str, target: str) -> tuple[str, int]:
    """NAME:PORT of a `--discover-*` flag."""
    name, _, port = target.rpartition(":")
    if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(flag, f"got {target!r}, expected NAME:PORT (a DNS name and a port)")
    return name, int(port)


def _add_membership_arguments(parser: argparse.ArgumentParser) -> None:
    d = ProxyConfig(prefill_decode=("http://x",))
    parser.add_argument(
        "--events-port",
        type=int,
        help="port on which every instance publishes its item events (their events_port); "
        "turns on the item directory",
    )
    parser.add_argument("--events-key", help="the proxy's CURVE secret key file for the feeds")
    parser.add_argument(
        "--events-encoder-key", help="public key (Z85 or file) encoders publish events under"
    )
    parser.add_argument(
        "--events-pd-key",
        help="public key prefill/decode instances publish under [default: --events-encoder-key]",
    )
    parser.add_argument(
        "--events-timeout",
        type=float,
        default=d.events_timeout_s,
        help=f"forget what a silent instance held after this many seconds ({d.events_timeout_s:g})",
    )
    parser.add_argument(
        "--directory-max-items",
        type=int,
        default=d.directory_max_items,
        help=f"most (instance, item) entries the directory keeps ({d.directory_max_items})",
    )
    parser.add_argument(
        "--admin-key-file",
        help="file holding the key that POST/DELETE /v1/members needs; unset: no registration",
    )
    parser.add_argument(
        "--discover-encoders", metavar="NAME:PORT", help="encoders: each address NAME resolves to"
    )
    parser.add_argument(
        "--discover-pd", metavar="NAME:PORT", help="prefill/decode: each address NAME resolves to"
    )
    parser.add_argument(
        "--discover-decode",
        metavar="NAME:PORT",
        help="decode instances (with --prefill): each address NAME resolves to",
    )
    parser.add_argument(
        "--discover-interval",
        type=float,
        default=d.discover_interval_s,
        help=f"seconds between DNS lookups ({d.discover_interval_s:g})",
    )


def _membership_values(args: argparse.Namespace) -> dict[str, Any]:
    admin_key = read_secret_file(args.admin_key_file, "--admin-key-file")
    if args.events_key is not None:
        # Read by each worker once it serves; refused here, before anything listens.
        check_secret_file(args.events_key, "--events-key")
    return {
        "events_port": args.events_port,
        "events_key_file": args.events_key,
        "events_encoder_key": args.events_encoder_key,
        "events_pd_key": args.events_pd_key,
        "events_timeout_s": args.events_timeout,
        "directory_max_items": args.directory_max_items,
        "admin_key": admin_key,
        "discover_encoders": args.discover_encoders,
        "discover_pd": args.discover_pd,
        "discover_decode": args.discover_decode,
        "discover_interval_s": args.discover_interval,
    }


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ecshare proxy` flags; `config_from_args` turns their values into a `ProxyConfig`."""
    d = ProxyConfig(prefill_decode=("http://x",))
    parser.add_argument(
        "--encoder",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="encoder instance base URLs (none: every request encodes on prefill/decode)",
    )
    parser.add_argument(
        "--pd",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL[=PUSH_NAME]",
        help="prefill/decode instance base URLs (at least one), each with its ecshare "
        "push_name where it takes pushes: the encoders then push a request's items to the "
        "instance chosen for it",
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL[=PUSH_NAME]",
        help="prefill instances (vLLM's KV connector as kv_producer), in place of --pd: each "
        "request is prefilled on one and decoded on a --decode instance",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="decode instances (vLLM's KV connector as kv_consumer), with --prefill",
    )
    parser.add_argument("--host", default=d.host, help=f"address to listen on ({d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"port, 0 for any ({d.port})")
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="API keys, one a line, each optionally followed by its tenant (`KEY TENANT`; "
        "a key alone is the tenant `default`): required as `Authorization: Bearer` on /v1/* "
        f"and for /health's details (else ${API_KEY_ENV}, one key)",
    )
    parser.add_argument(
        "--client-uuids",
        choices=UUID_MODES,
        default=d.client_uuids,
        help="a client's `uuid` on a media part names a cache entry others share: refuse "
        "it (400), strip it, or scope it to the client's tenant (tenant) "
        f"({d.client_uuids})",
    )
    parser.add_argument(
        "--max-uuid-chars",
        type=int,
        default=d.max_uuid_chars,
        help=f"longest client uuid accepted, in any mode ({d.max_uuid_chars})",
    )
    parser.add_argument(
        "--allow-client-embeds",
        action="store_true",
        help="accept image_embeds/audio_embeds/video_embeds/prompt_embeds from clients "
        "(trusted clients only: they name or fill cache entries others use)",
    )
    parser.add_argument(
        "--tenant-isolation",
        action="store_true",
        help="key each tenant's media apart, so that no cache entry is shared between "
        "tenants (no cross-tenant hit)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=_limits,
        default={},
        metavar="JSON",
        help="media items per request and modality, as given to the instances (vLLM's "
        'flag), e.g. \'{"image": 2, "video": 0}\'; refused before any encoder call (999 '
        "each, vLLM's default)",
    )
    counts = (
        ("--max-encoder-calls", d.max_encoder_calls, "encoder calls per request"),
        ("--max-encoder-in-flight", d.max_encoder_in_flight, "encoder calls in flight"),
        (
            "--max-in-flight-per-encoder",
            d.max_in_flight_per_encoder,
            "of those, per encoder in rotation (more wait in the proxy, fair between tenants)",
        ),
        ("--max-tenant-in-flight", d.max_tenant_in_flight, "requests in flight per tenant"),
        ("--max-connections", d.max_connections, "open client connections per process"),
        (
            "--max-image-pixels",
            d.max_image_pixels,
            "pixels of an inline image or video frame, read from its header",
        ),
        ("--max-video-frames", d.max_video_frames, "frames of an inline video"),
    )
    for flag, count, text in counts:
        parser.add_argument(flag, type=int, default=count, help=f"{text} ({count})")
    shares = (
        (
            "--max-connections-per-address",
            "open connections of one client address per process",
            "an eighth of --max-connections",
        ),
        (
            "--max-preauth-connections",
            "connections per process that have not yet shown a key and sent a whole body",
            "a quarter of --max-connections",
        ),
        (
            "--max-tenant-encoder-in-flight",
            "encoder calls in flight for one tenant",
            "half of the encoder slots",
        ),
    )
    for flag, text, derived in shares:
        parser.add_argument(flag, type=int, default=0, help=f"{text} ({derived})")
    parser.add_argument(
        "--max-in-flight-per-pd",
        type=int,
        default=0,
        metavar="N",
        help="requests in flight to each prefill/decode instance in rotation; more wait in "
        "the proxy, fair between tenants, each holding at most half (0: no bound)",
    )
    parser.add_argument(
        "--max-body",
        metavar="SIZE",
        help=f"largest request body accepted: 64MiB, 512KiB ({d.max_body_bytes // MiB}MiB)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        help="the same in MiB, a number (--max-body takes units)",
    )
    parser.add_argument(
        "--encoder-batch",
        type=int,
        default=d.encoder_batch_size,
        help="media items per encoder call (1)",
    )
    timeouts = (
        ("--encoder-timeout", d.encoder_timeout_s, "one encoder call, seconds"),
        ("--pd-timeout", d.pd_timeout_s, "longest silence from prefill/decode, seconds"),
        ("--connect-timeout", d.connect_timeout_s, "TCP connect to any backend, seconds"),
        ("--health-interval", d.health_interval_s, "seconds between health checks"),
        ("--health-timeout", d.health_timeout_s, "one health check, seconds"),
        ("--body-timeout", d.body_timeout_s, "longest a request body may take, seconds"),
        (
            "--first-byte-timeout",
            d.first_byte_timeout_s,
            "a new connection's first byte, seconds",
        ),
        (
            "--header-timeout",
            d.header_timeout_s,
            "a new connection's whole request header, seconds",
        ),
        ("--keepalive-timeout", d.keepalive_timeout_s, "idle time between requests, seconds"),
        (
            "--encoder-slot-wait",
            d.encoder_slot_wait_s,
            "longest wait for an encoder slot before 429, seconds",
        ),
        (
            "--pd-slot-wait",
            d.pd_slot_wait_s,
            "longest wait for a prefill/decode slot (--max-in-flight-per-pd) before 429, seconds",
        ),
        ("--max-audio-seconds", d.max_audio_seconds, "seconds of inline audio"),
    )
    for flag, default, text in timeouts:
        parser.add_argument(flag, type=float, default=default, help=f"{text} ({default:g})")
    parser.add_argument(
        "--eject-after",
        type=int,
        default=d.eject_after_failures,
        help="consecutive failed calls that eject a backend until it is healthy again (3)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="proxy processes sharing the port, one event loop and core each (1)",
    )
    parser.add_argument(
        "--pd-media",
        choices=PD_MEDIA,
        default=d.pd_media,
        help="omit: send prefill/decode each encoded item as its placeholder metadata only, "
        "where the encoder published it (retried once with the media if a fetch fails); "
        f"keep: always forward the media ({d.pd_media})",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default=d.routing,
        help="reuse: items some instance holds skip the encoders, prefill/decode is chosen "
        "by the request's items in its region against its load, and each new content is "
        "encoded once; load: every media part to an encoder, prefill/decode by load, as "
        f"vLLM's example EPD proxy ({d.routing})",
    )
    parser.add_argument(
        "--url-ttl",
        type=float,
        default=d.url_ttl_s,
        metavar="SECONDS",
        help="trust an http/https media URL to name the same content for this long, so "
        "that it may be reused like inline media; 0: encode it every time (0)",
    )
    parser.add_argument(
        "--route-cache-items",
        type=int,
        default=d.route_cache_items,
        help=f"content keys remembered with their items ({d.route_cache_items})",
    )
    parser.add_argument(
        "--route-load-weight",
        type=float,
        default=d.route_load_weight,
        help="what a request in flight on a prefill/decode instance weighs against one "
        f"of the request's items held there ({d.route_load_weight:g})",
    )
    parser.add_argument(
        "--tenant-secret-file",
        metavar="PATH",
        help="the secret (0600, 32+ characters) that keys each tenant's salt under "
        "--tenant-isolation; give every proxy in front of the same instances the same one "
        "(unset: each proxy makes its own at start)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--pass-ec-transfer-params",
        action="store_true",
        help="forward ec_transfer_params that clients write into request bodies (by default "
        "they are dropped and counted: they would choose where prefill/decode fetches from)",
    )
    parser.add_argument(
        "--route-headers",
        action="store_true",
        help="add x-ecshare-route and Server-Timing to each routed answer: they name the "
        "prefill/decode instance and say whether the request's media was held already "
        "(perhaps sent by another tenant), so only for trusted callers and benchmarks; "
        "the proxy's log and metrics say the same without them (off)",
    )
    _add_membership_arguments(parser)


def _max_body_bytes(args: argparse.Namespace) -> int:
    """`--max-body SIZE` (units) or `--max-body-mb N`, not both; the default without either."""
    if args.max_body is not None and args.max_body_mb is not None:
        raise ConfigError("--max-body", "give --max-body or --max-body-mb, not both")
    if args.max_body is not None:
        try:
            return parse_size(args.max_body)
        except ValueError as exc:
            raise ConfigError("--max-body", str(exc)) from None
    if args.max_body_mb is not None:
        return int(args.max_body_mb * MiB)
    return DEFAULT_MAX_BODY_BYTES


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """The `ProxyConfig` of parsed `ecshare proxy` flags (and the API key variable)."""
    env = os.environ if environ is None else environ
    api_key, api_keys = _api_keys(args.api_key_file, env)
    decoding = bool(args.decode) or args.discover_decode is not None
    if (args.prefill or decoding) and args.pd:
        raise ConfigError(
            "--prefill", "give --pd (combined instances) or --prefill with --decode, not both"
        )
    if bool(args.prefill) != decoding and not (decoding and args.discover_pd is not None):
        raise ConfigError(
            "--prefill" if args.prefill else "--decode",
            "--prefill and --decode go together: prefill instances hand their KV to decode ones",
        )
    first = args.prefill or args.pd
    values: dict[str, Any] = {
        "encoders": tuple(u.rstrip("/") for u in args.encoder),
        "prefill_decode": tuple(u.partition("=")[0].rstrip("/") for u in first),
        "pd_push_names": _push_names(first),
        "decode": tuple(u.rstrip("/") for u in args.decode),
        "host": args.host,
        "port": args.port,
        "api_key": api_key,
        "api_keys": api_keys,
        "max_body_bytes": _max_body_bytes(args),
        "encoder_batch_size": args.encoder_batch,
        "encoder_timeout_s": args.encoder_timeout,
        "pd_timeout_s": args.pd_timeout,
        "connect_timeout_s": args.connect_timeout,
        "health_interval_s": args.health_interval,
        "health_timeout_s": args.health_timeout,
        "eject_after_failures": args.eject_after,
        "access_log": args.access_log,
        "workers": args.workers,
        "pass_ec_transfer_params": args.pass_ec_transfer_params,
        "route_headers": args.route_headers,
        "pd_media": args.pd_media,
        "client_uuids": args.client_uuids,
        "max_uuid_chars": args.max_uuid_chars,
        "allow_client_embeds": args.allow_client_embeds,
        "tenant_isolation": args.tenant_isolation,
        "limit_mm_per_prompt": args.limit_mm_per_prompt,
        "max_encoder_calls": args.max_encoder_calls,
        "max_encoder_in_flight": args.max_encoder_in_flight,
        "max_in_flight_per_encoder": args.max_in_flight_per_encoder,
        "max_tenant_in_flight": args.max_tenant_in_flight,
        "max_connections": args.max_connections,
        "max_connections_per_address": args.max_connections_per_address,
        "max_preauth_connections": args.max_preauth_connections,
        "first_byte_timeout_s": args.first_byte_timeout,
        "header_timeout_s": args.header_timeout,
        "keepalive_timeout_s": args.keepalive_timeout,
        "body_timeout_s": args.body_timeout,
        "max_tenant_encoder_in_flight": args.max_tenant_encoder_in_flight,
        "encoder_slot_wait_s": args.encoder_slot_wait,
        "max_in_flight_per_pd": args.max_in_flight_per_pd,
        "pd_slot_wait_s": args.pd_slot_wait,
        "max_image_pixels": args.max_image_pixels,
        "max_video_frames": args.max_video_frames,
        "max_audio_seconds": args.max_audio_seconds,
        "tenant_secret": read_secret_file(args.tenant_secret_file, "--tenant-secret-file"),
        **_membership_values(args),
        "routing": args.routing,
        "url_ttl_s": args.url_ttl,
        "route_cache_items": args.route_cache_items,
        "route_load_weight": args.route_load_weight,
    }
    return ProxyConfig(**values)


def _push_names(pd: list[str]) -> tuple[str, ...]:
    """The push names of `--pd URL=PUSH_NAME` values, "" where none; () when none has one."""
    names = tuple(u.partition("=")[2] for u in pd)
    return names if any(names) else ()


def _api_keys(path: str | None, environ: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """The one key of tenant "default" (a file of one bare key, or the variable), or the
    keys of a file with tenants."""
    if path is not None:
        keys = read_key_file(path)
        if len(keys) == 1 and DEFAULT_TENANT in keys.values():
            return next(iter(keys)), {}
        return None, keys
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None, {}


def _limits(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`'s JSON object (checked by `ProxyConfig`)."""
    try:
        value = msgspec.json.decode(text, type=dict[str, int])
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object of counts: {exc}") from None
    return value
