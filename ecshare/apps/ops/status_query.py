"""`ecshare status ADDRESS`: ask a running producer what it holds and serves.

The query travels over the producer's CURVE control plane like any consumer
message, through the same `ControlClient` and handshake; the producer answers
only keys on its admin list (its own key, `admin_keys`, `admin_keys_file`).
Without a key, with a key the producer does not know, or with a key that is
not an admin, the command says so and exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import msgspec

from ecshare import protocol as p
from ecshare.apps.bench.synthetic import format_size
from ecshare.apps.ops.table import render_table
from ecshare.config import Config, add_config_arguments, load_config
from ecshare.control import (
    AuthenticationFailed,
    ControlClient,
    ControlConfigError,
    KeyPair,
    LinkSettings,
    load_keypair,
    load_public_key,
)

EXIT_OK = 0
EXIT_REFUSED = 1  # unreachable, not authenticated, not an admin
EXIT_USAGE = 2


class StatusFailed(Exception):
    """The producer could not be asked, or would not answer; the message says what to do."""


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="producer control endpoint, e.g. tcp://127.0.0.1:5701")
    parser.add_argument(
        "--key",
        metavar="FILE",
        help="this client's CURVE secret key file (NAME.key_secret); the producer must list "
        "its public key as an admin key [default: client_secret_key_file]",
    )
    parser.add_argument(
        "--server-key",
        metavar="FILE_OR_Z85",
        help="the producer's CURVE public key, as a file or 40 characters of Z85 "
        "[default: server_public_key / server_public_key_file]",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait in all")
    parser.add_argument("--json", action="store_true", help="print the reply as one JSON object")
    add_config_arguments(parser)


def run_status(args: argparse.Namespace) -> int:
    config = load_config(cli=args)
    try:
        keys, server_key = _credentials(args, config)
        reply = query_status(
            args.address,
            keys=keys,
            server_public_key=server_key,
            insecure=config.insecure,
            timeout_s=args.timeout,
            max_frame_bytes=config.max_frame_bytes,
        )
    except ControlConfigError as exc:
        print(f"ecshare status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StatusFailed as exc:
        print(f"ecshare status: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(render_status(reply, args.address))
    return EXIT_OK


def _credentials(args: argparse.Namespace, config: Config) -> tuple[KeyPair | None, bytes | None]:
    if config.insecure:
        return None, None
    key_file = args.key or config.client_secret_key_file
    if not key_file:
        raise ControlConfigError(
            "no client key: the producer answers status only over CURVE, to admin keys. "
            "Pass --key FILE (a NAME.key_secret whose public key the producer lists in "
            "admin_keys or admin_keys_file, or the producer's own secret key)"
        )
    server = args.server_key or config.server_public_key or config.server_public_key_file
    if not server:
        raise ControlConfigError(
            "no producer public key: pass --server-key FILE_OR_Z85 (the producer's NAME.key), "
            "so that this client can authenticate the producer"
        )
    return load_keypair(key_file), load_public_key(server)


def query_status(
    endpoint: str,
    *,
    keys: KeyPair | None,
    server_public_key: bytes | None,
    insecure: bool = False,
    timeout_s: float = 5.0,
    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
) -> p.StatusReply:
    """One StatusRequest over an authenticated connection; raises `StatusFailed`."""
    deadline = time.monotonic() + timeout_s
    client = ControlClient(
        endpoint,
        server_public_key=server_public_key,
        keys=keys,
        insecure=insecure,
        settings=LinkSettings(
            max_frame_bytes=max_frame_bytes, handshake_timeout_s=max(0.1, timeout_s)
        ),
    )
    try:
        try:
            ready = client.wait_ready(_ms_left(deadline))
        except AuthenticationFailed as exc:
            raise StatusFailed(
                f"{endpoint} refused the connection: {exc.reason}. To query status, list this "
                "key's public key in the producer's admin_keys_file (or admin_keys)"
            ) from None
        if not ready:
            raise StatusFailed(
                f"no connection to {endpoint} within {timeout_s:g} s: is a producer listening "
                "there, and is the address right?"
            )
        request_id = uuid.uuid4().hex
        client.send(p.StatusRequest(request_id=request_id))
        while True:
            reply = client.recv(timeout_ms=_ms_left(deadline))
            if reply is None:
                raise StatusFailed(
                    f"{endpoint} did not answer within {timeout_s:g} s (a producer too old "
                    "to know status requests drops them)"
                )
            if isinstance(reply, p.StatusReply) and reply.request_id == request_id:
                return reply
            if isinstance(reply, p.Error):
                if reply.code is p.ErrorCode.FORBIDDEN:
                    raise StatusFailed(
                        f"{endpoint} refused: {reply.message}. Add this key's public key "
                        f"({keys.public_text if keys else '-'}) to the producer's admin_keys"
                    )
                raise StatusFailed(f"{endpoint} answered {reply.code.value}: {reply.message}")
    finally:
        client.close()


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


def render_status(reply: p.StatusReply, address: str) -> str:
    """The reply as an operator reads it: a summary, then one row per session."""
    by_state = ", ".join(f"{n} {state}" for state, n in sorted(reply.entries_by_state.items()))
    used_pct = 100.0 * reply.blocks_used / reply.blocks_total if reply.blocks_total else 0.0
    summary = [
        ("producer", f"{reply.server_name} at {address}"),
        ("uptime", _duration(reply.uptime_ms / 1000)),
        ("protocol", f"v{reply.protocol_version}, fingerprint {reply.fingerprint}"),
        ("entries", f"{reply.entries} ({by_state})"),
        (
            "region",
            f"{format_size(reply.used_bytes)} used, {format_size(reply.free_bytes)} free of "
            f"{format_size(reply.region_bytes)} ({used_pct:.1f} %); blocks "
            f"{reply.blocks_used} used, {reply.blocks_free} free of {reply.blocks_total} "
            f"x {format_size(reply.block_bytes)}; payload {format_size(reply.payload_bytes)}",
        ),
        (
            "quarantined",
            f"{format_size(reply.quarantined_bytes)} held for reads that may still be in flight"
            + (
                f"; {reply.canary_violations} writes after free caught by the canary"
                if reply.canary_violations
                else ""
            ),
        ),
        (
            "grants",
            f"{reply.grants_active} active on {reply.pinned_entries} entries, "
            f"{format_size(reply.pinned_bytes)} pinned",
        ),
        ("sessions", f"{reply.sessions_total} from {reply.peers} peer key(s)"),
    ]
    width = max(len(k) for k, _ in summary)
    lines = [f"{k.ljust(width)}  {v}" for k, v in summary]
    if reply.sessions:
        rows = [
            [
                s.key_fingerprint,
                s.client_name,
                str(s.grants),
                format_size(s.pinned_bytes),
                f"{s.idle_ms / 1000:.1f} s",
            ]
            for s in reply.sessions
        ]
        lines += ["", render_table(["peer key", "client", "grants", "pinned", "idle"], rows)]
        hidden = reply.sessions_total - len(reply.sessions)
        if hidden > 0:
            lines.append(f"... and {hidden} more sessions (over the frame limit; counted above)")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{seconds:.1f}s"
