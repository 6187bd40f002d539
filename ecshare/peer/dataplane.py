"""A data plane's `PeerInfo` (the transport's word) as the protocol's `DataPlaneInfo`
(the handshake's), and back: the one mapping both peers use in Hello and Welcome."""

from __future__ import annotations

import os

from ecshare import protocol as p
from ecshare.peer.peek import host_identity
from ecshare.transport.base import PeerInfo


def announced(info: PeerInfo, *, layout: bool = True) -> p.DataPlaneInfo:
    """`info` as a handshake carries it, with where this process runs (`host`, `pid`);
    without `layout`, the agent's name only (no metadata, no region, no process),
    for a peer that must not learn where our memory lies."""
    if not layout:
        return p.DataPlaneInfo(kind=info.kind, agent_name=info.agent_name)
    return p.DataPlaneInfo(
        kind=info.kind,
        agent_name=info.agent_name,
        agent_metadata=info.agent_metadata,
        region_address=info.region_address,
        region_size=info.region_size,
        host=host_identity(),
        pid=os.getpid(),
    )


def peer_info(dp: p.DataPlaneInfo) -> PeerInfo:
    """What a handshake announced, as the transport loads it (`add_peer`)."""
    return PeerInfo(dp.kind, dp.agent_name, dp.agent_metadata, dp.region_address, dp.region_size)
