"""A producer's answer to `StatusRequest`: one consistent look at what it holds and serves.

Only keys on the producer's admin list get it (see docs/SECURITY.md): it lists
every session, which no consumer may otherwise learn. A session's key is shown
as a digest, never as the key itself, so a status dump pasted into a ticket does
not name the allow-list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
from zmq.utils import z85

from ecshare import protocol as p
from ecshare.store import Store

# Room left in a frame for everything but the session list.
_FRAME_HEADROOM = 1024


def key_fingerprint(user: str) -> str:
    """A short, stable digest of a CURVE public key (Z85), for display: 'sha256:<16 hex>'."""
    if not user:
        return "unauthenticated"
    try:
        raw = z85.decode(user.encode("ascii"))
    except (ValueError, KeyError, UnicodeEncodeError):
        raw = user.encode("utf-8", "replace")
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SessionView:
    """What the producer's thread reads off one session for a status reply."""

    user: str
    client_name: str
    version: int
    grants: int
    pinned_bytes: int
    idle_s: float


def status_reply(
    *,
    request_id: str,
    server_name: str,
    fingerprint: str,
    uptime_s: float,
    store: Store,
    sessions: Sequence[SessionView],
    counters: Mapping[str, int],
    max_frame_bytes: int,
) -> p.StatusReply:
    """The reply, with as many sessions listed as fit in one frame (all are counted)."""
    stats = store.stats()
    region_bytes = stats.total_blocks * stats.block_size  # the blocks; their tags lie past
    used_bytes = stats.used_blocks * stats.block_size
    listed = [
        p.SessionStatus(
            key_fingerprint=key_fingerprint(s.user),
            client_name=s.client_name,
            version=s.version,
            grants=s.grants,
            pinned_bytes=s.pinned_bytes,
            idle_ms=max(0, int(s.idle_s * 1000)),
        )
        for s in sorted(sessions, key=lambda s: (-s.pinned_bytes, s.client_name))
    ][: p.MAX_STATUS_SESSIONS]
    reply = p.StatusReply(
        request_id=request_id,
        server_name=server_name,
        protocol_version=p.PROTOCOL_VERSION,
        fingerprint=fingerprint,
        uptime_ms=max(0, int(uptime_s * 1000)),
        entries=stats.entries,
        entries_by_state={
            "allocated": stats.allocated,
            "ready": stats.ready,
            "evicting": stats.evicting,
            "quarantined": stats.quarantined,
        },
        region_bytes=region_bytes,
        block_bytes=stats.block_size,
        blocks_total=stats.total_blocks,
        blocks_used=stats.used_blocks,
        blocks_free=stats.free_blocks,
        used_bytes=used_bytes,
        payload_bytes=stats.bytes_used,
        free_bytes=stats.free_blocks * stats.block_size,
        quarantined_bytes=stats.quarantined_blocks * stats.block_size,
        canary_violations=stats.canary_violations,
        grants_active=sum(s.grants for s in sessions),
        pinned_entries=stats.pinned_entries,
        pinned_bytes=sum(s.pinned_bytes for s in sessions),
        sessions_total=len(sessions),
        peers=len({s.user for s in sessions}),
        sessions=listed,
        counters=dict(
            [(k, v) for k, v in sorted(counters.items()) if v >= 0 and 0 < len(k) <= 128][:256]
        ),
    )
    # Halve the session list until the reply fits the frame limit; the totals stay.
    budget = max_frame_bytes - _FRAME_HEADROOM
    while listed and len(msgspec.msgpack.encode(reply)) > budget:
        listed = listed[: len(listed) // 2]
        reply = msgspec.structs.replace(reply, sessions=listed)
    return reply
