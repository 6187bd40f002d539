"""The item directory against a real item feed: a store and its feed in another process,
the proxy's subscriber over CURVE on 127.0.0.1. Lost events and a restarted instance end
in a resync to exactly what the store holds; a key the instance does not list gets
nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.feeds import DirectoryFeeds, events_address
from ecshare.config import Config
from ecshare.control import KeyPair, generate_keypair, load_keypair
from ecshare.control.errors import ControlConfigError
from ecshare.peer.items import feed_from_config
from ecshare.store import Region, Store

CHILD = Path(__file__).with_name("feed_child.py")
BACKEND = "http://127.0.0.1:9"
WAIT_S = 60.0


class Child:
    """The feed process: commands in, its store's state out."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(settings) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("port "), line
        self.port = int(line.split()[1])

    def __call__(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return answer

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    files = generate_keypair(tmp_path, "instance")
    return {
        "instance_file": str(files.secret_path),
        "instance": load_keypair(files.secret_path),
        "proxy": KeyPair.generate(),
        "stranger": KeyPair.generate(),
    }


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def start(children: list[Child], keys: dict[str, Any], port: int = 0, **extra: Any) -> Child:
    settings = {
        "port": port,
        "secret_key_file": keys["instance_file"],
        "subscribers": [keys["proxy"].public_text],
        **extra,
    }
    child = Child(settings)
    children.append(child)
    return child


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def claims(directory: ItemDirectory, hashes: list[str]) -> set[str]:
    return {h for h in hashes if BACKEND in directory.holders(h)}


def test_directory_resyncs_to_exactly_what_a_real_feed_holds_after_lost_events(
    keys: dict[str, Any], children: list[Child]
) -> None:
    # A queue of 2 loses most of a flood: the sequence numbers it spends are the gap.
    child = start(children, keys, queue_max=2)

    async def run() -> None:
        # Two proxy workers, each with its own subscription, end with the same picture.
        directory, other = ItemDirectory(), ItemDirectory()
        feeds = DirectoryFeeds(directory, keys=keys["proxy"], resync_s=0.2)
        other_feeds = DirectoryFeeds(other, keys=keys["proxy"], resync_s=0.2)
        for f in (feeds, other_feeds):
            f.watch(
                BACKEND,
                events_address(BACKEND, child.port),
                encoder=True,
                server_key=keys["instance"].public,
            )
        await until(lambda: directory.synced(BACKEND), "synced")
        child("put a")
        child("put b")
        await until(lambda: claims(directory, ["a", "b"]) == {"a", "b"}, "a and b held")
        child("evict a")
        state = child("flood 300")
        assert state["stats"]["dropped"] > 0
        assert state["held"] == ["b"]
        everything = ["a", "b", *(f"f{i}" for i in range(300))]
        await until(
            lambda: directory.synced(BACKEND) and claims(directory, everything) == {"b"},
            "resynced to b alone",
        )
        assert directory.stats()["gaps"] >= 1
        assert feeds.stats()["resync_requests"] >= 1
        # Quiet now: heartbeats keep it synced, and nothing gone comes back.
        heartbeats = child("state")["stats"]["heartbeats"]
        await until(lambda: child("state")["stats"]["heartbeats"] >= heartbeats + 2, "beats")
        assert directory.synced(BACKEND) and claims(directory, everything) == {"b"}
        await until(
            lambda: other.synced(BACKEND) and claims(other, everything) == {"b"}, "the other too"
        )
        await feeds.close()
        await other_feeds.close()

    asyncio.run(run())


def test_a_restarted_instance_loses_everything_its_old_incarnation_held(
    keys: dict[str, Any], children: list[Child]
) -> None:
    first = start(children, keys)

    async def run() -> None:
        directory = ItemDirectory()
        feeds = DirectoryFeeds(directory, keys=keys["proxy"], resync_s=0.2)
        feeds.watch(
            BACKEND,
            events_address(BACKEND, first.port),
            encoder=False,
            server_key=keys["instance"].public,
        )
        first("put a")
        first("put b")
        await until(lambda: claims(directory, ["a", "b"]) == {"a", "b"}, "a and b held")
        first.kill()
        second = start(children, keys, port=first.port)
        second("put c")
        await until(lambda: claims(directory, ["a", "b", "c"]) == {"c"}, "only c held")
        assert directory.stats()["restarts"] == 1
        await feeds.close()

    asyncio.run(run())


def test_a_subscriber_whose_key_the_instance_does_not_list_gets_nothing(
    keys: dict[str, Any], children: list[Child]
) -> None:
    child = start(children, keys)

    async def run() -> None:
        listed, stranger = ItemDirectory(), ItemDirectory()
        feeds = DirectoryFeeds(listed, keys=keys["proxy"], resync_s=0.2)
        stranger_feeds = DirectoryFeeds(stranger, keys=keys["stranger"], resync_s=0.2)
        address = events_address(BACKEND, child.port)
        for f in (feeds, stranger_feeds):
            f.watch(BACKEND, address, encoder=True, server_key=keys["instance"].public)
        child("put a")
        # Proof the feed runs and the stranger tried: the listed key has it, and the
        # instance refused a handshake.
        await until(lambda: claims(listed, ["a"]) == {"a"}, "a held")
        await until(lambda: child("state")["stats"]["refused"] >= 1, "stranger refused")
        assert claims(stranger, ["a"]) == set()
        assert not stranger.synced(BACKEND)
        assert stranger.stats()["applied"] == stranger.stats()["snapshots"] == 0
        await feeds.close()
        await stranger_feeds.close()

    asyncio.run(run())


def test_events_port_without_a_subscriber_key_is_a_clear_error(tmp_path: Path) -> None:
    files = generate_keypair(tmp_path, "instance")
    config = Config(events_port=0, server_secret_key_file=str(files.secret_path))
    region = Region.create(1 << 16, name="feed-test", prefault=False)
    try:
        with pytest.raises(ControlConfigError, match="admin_keys"):
            feed_from_config(Store(region, 4096), config)
        assert feed_from_config(Store(region, 4096), Config()) is None
    finally:
        region.close()
