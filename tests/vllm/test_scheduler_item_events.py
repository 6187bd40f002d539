"""Item events from real vLLM Schedulers (see conftest.py): an encoder's stored entry and a
prefill/decode instance's fetched one reach a proxy's item directory over CURVE, each
from the instance's own feed (`events_port`), and a removed entry leaves it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from conftest import EC, embedding

from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.feeds import DirectoryFeeds
from ecshare.control import KeyPair, load_keypair

ENCODER = "http://127.0.0.1:1"
PD = "http://127.0.0.1:2"


def test_stored_and_fetched_entries_reach_the_directory_and_evicted_ones_leave(ec: EC) -> None:
    proxy = KeyPair.generate()
    admin: dict[str, Any] = {"events_port": 0, "admin_keys": [proxy.public_text]}
    producer = ec.scheduler("ec_producer", **admin)
    consumer = ec.scheduler("ec_consumer", **admin)
    feeds_of = {ENCODER: ec.side(producer).feed, PD: ec.side(consumer).feed}
    assert all(feed is not None for feed in feeds_of.values())

    async def until(check: Callable[[], bool], what: str) -> None:
        for _ in range(3000):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never: {what}")

    async def run() -> None:
        directory = ItemDirectory()
        feeds = DirectoryFeeds(directory, keys=proxy, resync_s=0.2)
        server_keys = {
            ENCODER: load_keypair(ec.producer_keys.secret_path).public,
            PD: load_keypair(ec.consumer_keys.secret_path).public,
        }
        for backend, feed in feeds_of.items():
            assert feed is not None
            feeds.watch(
                backend,
                feed.endpoint,
                encoder=backend == ENCODER,
                server_key=server_keys[backend],
            )
        await until(lambda: all(directory.synced(b) for b in feeds_of), "both synced")
        params = ec.encode(producer, "p1", "h-1", embedding())
        await until(lambda: directory.holders("h-1") == {ENCODER}, "stored")
        consumer.add_request(ec.request("c1", "h-1", params=params))
        ec.step_until(consumer, lambda s: "c1" in s.scheduled)
        await until(lambda: directory.holders("h-1") == {ENCODER, PD}, "fetched")
        assert directory.is_encoder(ENCODER) and not directory.is_encoder(PD)
        # Gone at the encoder (its pins, if a grant still holds any, keep only the blocks).
        assert ec.side(producer).store.remove("h-1")
        await until(lambda: directory.holders("h-1") == {PD}, "evicted")
        await feeds.close()

    asyncio.run(run())
