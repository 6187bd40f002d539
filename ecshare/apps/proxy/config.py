"""The proxy's one typed configuration, and the `ecshare proxy` flags that decode into it.

`ProxyConfig` is checked when it is constructed, so an invalid one cannot exist; every bad
value raises `ConfigError`, whose message names the flag and what is allowed. The API key
comes from `--api-key-file` or, failing that, the `ECSHARE_PROXY_API_KEY` environment
variable (allow-listed in `ecshare.config.decode`, so an instance's `load_config` does not
reject it as an unknown `ECSHARE_*` variable). It never appears in a repr.

This module imports no HTTP stack: the CLI builds its parser from it cheaply.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ecshare.config import ConfigError

API_KEY_ENV = "ECSHARE_PROXY_API_KEY"
MiB = 1 << 20
MAX_WORKERS = 256
# A prefill/decode instance's push name, as ecshare's `push_name` allows it.
_PUSH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# What a prefill/decode instance gets of a request's media once the encoders have answered.
PD_MEDIA = ("omit", "keep")


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the proxy listens, which backends it uses, and its limits and timeouts."""

    encoders: tuple[str, ...] = ()
    prefill_decode: tuple[str, ...]
    # Each prefill/decode instance's push name (`--pd URL=PUSH_NAME`), in the order of
    # `prefill_decode`, "" for one that takes no push; empty: none does. The encoders are
    # asked to push a request's items to the instance chosen for it.
    pd_push_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = 64 * MiB
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
    # "omit": each media item whose params carry its placeholder metadata reaches
    # prefill/decode as that metadata only (no download, decode or processing there);
    # "keep": the request goes with its media as the client sent it.
    pd_media: str = "omit"

    def __post_init__(self) -> None:
        if not self.prefill_decode:
            raise ConfigError("--pd", "at least one prefill/decode URL is required")
        for flag, urls in (("--encoder", self.encoders), ("--pd", self.prefill_decode)):
            for url in urls:
                _check_url(flag, url)
            if len(set(urls)) != len(urls):
                raise ConfigError(flag, f"got a URL twice in {list(urls)}")
        if self.pd_push_names:
            if len(self.pd_push_names) != len(self.prefill_decode):
                raise ConfigError("--pd", "one push name (or none) per prefill/decode URL")
            for name in self.pd_push_names:
                if name and not _PUSH_NAME.fullmatch(name):
                    raise ConfigError(
                        "--pd",
                        f"got push name {name!r}, expected 1-64 of A-Z a-z 0-9 . _ -, "
                        "not starting with . _ -",
                    )
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"got {self.port}, expected 0..65535")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key-file", "the API key is empty")
        if self.max_body_bytes < 1024:
            raise ConfigError(
                "--max-body-mb", f"got {self.max_body_bytes} bytes, expected >= 1 KiB"
            )
        if self.encoder_batch_size < 1:
            raise ConfigError("--encoder-batch", f"got {self.encoder_batch_size}, expected >= 1")
        if self.eject_after_failures < 1:
            raise ConfigError("--eject-after", f"got {self.eject_after_failures}, expected >= 1")
        if self.pd_media not in PD_MEDIA:
            raise ConfigError("--pd-media", f"got {self.pd_media!r}, expected one of {PD_MEDIA}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError("--workers", f"got {self.workers}, expected 1..{MAX_WORKERS}")
        for flag, value in (
            ("--encoder-timeout", self.encoder_timeout_s),
            ("--pd-timeout", self.pd_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
            ("--health-interval", self.health_interval_s),
            ("--health-timeout", self.health_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(flag, f"got {value!r}, expected a positive number of seconds")

    def __repr__(self) -> str:
        shown = {f: getattr(self, f) for f in self.__struct_fields__ if f != "api_key"}
        shown["api_key"] = None if self.api_key is None else "<hidden>"
        return "ProxyConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def _check_url(flag: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(flag, f"got {url!r}, expected a base URL such as http://host:8000")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(flag, f"got {url!r}, expected a base URL without a path")


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
    parser.add_argument("--host", default=d.host, help=f"address to listen on ({d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"port, 0 for any ({d.port})")
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"require this key as `Authorization: Bearer` on /v1/* (else ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_bytes / MiB,
        help=f"largest request body accepted, MiB ({d.max_body_bytes // MiB})",
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
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--pass-ec-transfer-params",
        action="store_true",
        help="forward ec_transfer_params that clients write into request bodies (by default "
        "they are dropped and counted: they would choose where prefill/decode fetches from)",
    )


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """The `ProxyConfig` of parsed `ecshare proxy` flags (and the API key variable)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {
        "encoders": tuple(u.rstrip("/") for u in args.encoder),
        "prefill_decode": tuple(u.partition("=")[0].rstrip("/") for u in args.pd),
        "pd_push_names": _push_names(args.pd),
        "host": args.host,
        "port": args.port,
        "api_key": _api_key(args.api_key_file, env),
        "max_body_bytes": int(args.max_body_mb * MiB),
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
        "pd_media": args.pd_media,
    }
    return ProxyConfig(**values)


def _push_names(pd: list[str]) -> tuple[str, ...]:
    """The push names of `--pd URL=PUSH_NAME` values, "" where none; () when none has one."""
    names = tuple(u.partition("=")[2] for u in pd)
    return names if any(names) else ()


def _api_key(path: str | None, environ: Mapping[str, str]) -> str | None:
    if path is not None:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError("--api-key-file", f"cannot read {path!r}: {exc.strerror}") from None
        if not key:
            raise ConfigError("--api-key-file", f"{path!r} is empty")
        return key
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None
