"""Wiring from one `Config` to a running Producer or Consumer.

A node owns its region, store and transport, so that an engine (or the CLI)
needs one call to start sharing and one to stop.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from ecshare.config import Config
from ecshare.control import KeyPair, load_authorized_keys, load_keypair, load_public_key
from ecshare.control.errors import ControlConfigError
from ecshare.peer.consumer import Consumer
from ecshare.peer.producer import Producer
from ecshare.store import Region, Store, tail_bytes
from ecshare.transport.base import DataTransport


def producer_keys(config: Config) -> tuple[KeyPair | None, frozenset[bytes]]:
    """The server key pair and client allow-list, or (None, empty) when insecure."""
    if config.insecure:
        return None, frozenset()
    if not config.server_secret_key_file:
        raise ControlConfigError(
            "server_secret_key_file: a producer needs a CURVE key pair "
            "(create one with `ecshare keys generate DIR --name producer`), "
            "or set insecure=true to run unauthenticated"
        )
    keys = load_keypair(config.server_secret_key_file)
    authorized = load_authorized_keys(config.authorized_keys_file, config.authorized_keys)
    if not authorized:
        raise ControlConfigError(
            "authorized_keys_file / authorized_keys: a producer admits only listed client "
            "public keys, and none are listed"
        )
    return keys, authorized


def producer_admins(config: Config, keys: KeyPair | None) -> frozenset[bytes]:
    """Keys that may query the producer's status: its own, plus the configured admins.

    Whoever holds the producer's secret key already controls the producer, so its
    own key adds no reach; any other key must be listed on purpose.
    """
    if keys is None:
        return frozenset()
    listed: frozenset[bytes] = frozenset()
    if config.admin_keys_file or config.admin_keys:
        listed = load_authorized_keys(config.admin_keys_file, config.admin_keys)
    return listed | {keys.public}


def consumer_keys(config: Config) -> tuple[KeyPair | None, bytes | None]:
    """The client key pair and the producers' public key, or (None, None) when insecure."""
    if config.insecure:
        return None, None
    if not config.client_secret_key_file:
        raise ControlConfigError(
            "client_secret_key_file: a consumer needs a CURVE key pair "
            "(create one with `ecshare keys generate DIR --name consumer`), "
            "or set insecure=true to run unauthenticated"
        )
    keys = load_keypair(config.client_secret_key_file)
    source = config.server_public_key or config.server_public_key_file
    if not source:
        raise ControlConfigError(
            "server_public_key / server_public_key_file: a consumer must know the producers' "
            "public key to authenticate them"
        )
    return keys, load_public_key(source)


def consumer_push_keys(config: Config, server_key: bytes | None) -> frozenset[bytes]:
    """Producer keys that may push to this consumer: `push_trusted_keys`, else the key it
    authenticates producers by. Empty when it takes no push (`push_name` unset)."""
    if not config.push_name or config.insecure:
        return frozenset()
    if config.push_trusted_keys:
        return load_authorized_keys(None, config.push_trusted_keys)
    return frozenset({server_key}) if server_key is not None else frozenset()


def make_transport(config: Config, name: str, *, serves_reads: bool = True) -> DataTransport:
    """The node's data plane. NIXL's progress thread runs (when configured) only
    where peers read from us: a consumer-only node progresses its own reads as it
    polls them, and a thread there competes with those polls (measured over
    UCX_TLS=tcp on 2 cores: a 1 MiB read 2 to 4 ms slower)."""
    from ecshare.transport.nixl import NixlTransport

    ucx_env = {}
    if config.ucx_tls:
        ucx_env["UCX_TLS"] = config.ucx_tls
    if config.ucx_net_devices:
        ucx_env["UCX_NET_DEVICES"] = config.ucx_net_devices
    return NixlTransport(
        name,
        backends=tuple(config.nixl_backends),
        progress_thread=config.nixl_progress_thread and serves_reads,
        ucx_env=ucx_env,
        keepalive=config.ucx_keepalive,
    )


def node_name(config: Config, role: str) -> str:
    base = config.instance_name or f"ecshare-{os.getpid()}"
    # Agent names must be unique per process lifetime: a restarted producer
    # under the same instance name is a new agent to its peers' transports.
    return f"{base}-{role}-{uuid.uuid4().hex[:8]}"


@dataclass
class Node:
    """A region, its store and a transport: what a Producer or Consumer stands on."""

    config: Config
    region: Region
    store: Store
    transport: DataTransport

    @classmethod
    def create(cls, config: Config, role: str, *, transport: DataTransport | None = None) -> Node:
        """A new region and store on `transport`, which the node then owns (closes);
        without one, the NIXL transport the config describes. Peers on another data
        plane (a `LoopbackTransport` in tests) must all be of that kind: a link refuses
        a peer whose data plane differs."""
        # Past the blocks, a word per block for the entries' tags (direct reads check
        # them): 0.012% of the region with 64 KiB blocks; then the landing for the
        # tags this node reads back from producers (64 KiB).
        tail = tail_bytes(config.region_bytes // config.block_bytes)
        region = Region.create(
            config.region_bytes + tail,
            name=f"ecshare-{role}",
            prefault=config.prefault,
            hugepages=config.region_hugepages,
        )
        try:
            store = Store(region, config.block_bytes, canary=config.store_canary, tags=True)
            if transport is None:
                transport = make_transport(
                    config, node_name(config, role), serves_reads=role != "consumer"
                )
        except BaseException:
            region.close()
            raise
        return cls(config, region, store, transport)

    def close(self) -> None:
        self.transport.close()
        self.region.close()


def start_producer(node: Node, *, fingerprint: str, name: str = "") -> Producer:
    keys, authorized = producer_keys(node.config)
    return Producer(
        node.store,
        node.config,
        fingerprint=fingerprint,
        transport=node.transport,
        keys=keys,
        authorized=authorized,
        admins=producer_admins(node.config, keys),
        name=name or node_name(node.config, "producer"),
    ).start()


def start_consumer(node: Node, *, fingerprint: str, name: str = "") -> Consumer:
    keys, server_key = consumer_keys(node.config)
    return Consumer(
        node.store,
        node.config,
        fingerprint=fingerprint,
        transport=node.transport,
        keys=keys,
        server_public_key=server_key,
        name=name or node_name(node.config, "consumer"),
        push_keys=consumer_push_keys(node.config, server_key),
    ).start()
