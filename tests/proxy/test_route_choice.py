"""Routing's choices: prefill/decode by items held against load, encoders by rendezvous,
one encode per content in flight, and the ec_transfer_params schema they read."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from proxy_testing import Feeds

from ecshare.apps.proxy.backends import BackendPool
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.routing import SingleFlight, choose_prefill_decode, rendezvous, score
from ecshare.protocol import ParamsError, TransferParam, decode_items, decode_push_request

PD = ("http://pd1:8000", "http://pd2:8000")
ENCODERS = ("http://e1:8000", "http://e2:8000", "http://e3:8000")


def pool(urls: tuple[str, ...]) -> BackendPool:
    return BackendPool("prefill_decode", urls, eject_after=3, metrics=ProxyMetrics())


def test_the_score_is_items_held_less_weighted_load() -> None:
    assert score(3, 2, 1.0) == 1.0
    assert score(3, 2, 0.5) == 2.0
    assert score(0, 4, 1.0) == -4.0


def test_a_later_turn_lands_where_its_earlier_items_are() -> None:
    pds = pool(PD)
    feeds = Feeds()
    feeds.store(PD[1], "h1", "h2")
    directory = feeds.directory
    pds.backends[1].in_flight = 1  # busier, but holds two of the request's items
    chosen, held = choose_prefill_decode(pds, directory, {"h1", "h2", "h3"}, 1.0)
    assert chosen is pds.backends[1] and held == 2


def test_load_outweighs_items_held_past_the_weight() -> None:
    pds = pool(PD)
    feeds = Feeds()
    feeds.store(PD[1], "h1", "h2")
    directory = feeds.directory
    pds.backends[1].in_flight = 3  # score 2 - 3 = -1, against the idle one's 0
    chosen, held = choose_prefill_decode(pds, directory, {"h1", "h2"}, 1.0)
    assert chosen is pds.backends[0] and held == 0
    # A lighter weight for load keeps the request with its items.
    chosen, held = choose_prefill_decode(pds, directory, {"h1", "h2"}, 0.5)
    assert chosen is pds.backends[1] and held == 2


def test_with_nothing_held_the_least_loaded_instance_is_chosen_in_turn() -> None:
    pds = pool(PD)
    directory = Feeds().directory
    picked = {choose_prefill_decode(pds, directory, {"h1"}, 1.0)[0] for _ in range(4)}
    assert picked == set(pds.backends)
    pds.backends[0].in_flight = 2
    assert choose_prefill_decode(pds, directory, set(), 1.0) == (pds.backends[1], 0)


def test_an_ejected_holder_is_not_chosen() -> None:
    pds = pool(PD)
    feeds = Feeds()
    feeds.store(PD[1], "h1")
    directory = feeds.directory
    pds.backends[1].healthy = False
    assert choose_prefill_decode(pds, directory, {"h1"}, 1.0) == (pds.backends[0], 0)


def test_every_proxy_sends_a_content_to_the_same_encoder_and_contents_spread() -> None:
    one = pool(ENCODERS).backends
    other = pool(tuple(reversed(ENCODERS))).backends  # another process, listed otherwise
    keys = [f"key-{i}" for i in range(300)]
    chosen = [rendezvous(k, one) for k in keys]
    elsewhere = [rendezvous(k, other) for k in keys]
    assert [b.url for b in chosen if b] == [b.url for b in elsewhere if b]
    counts = {url: sum(1 for b in chosen if b and b.url == url) for url in ENCODERS}
    assert all(60 < n < 140 for n in counts.values()), counts


def test_an_encoder_out_of_rotation_leaves_its_contents_to_load() -> None:
    encoders = pool(ENCODERS).backends
    first = rendezvous("key", encoders)
    assert first is not None
    first.healthy = False
    assert rendezvous("key", encoders) is None
    assert rendezvous("key", ()) is None


def test_a_content_in_flight_is_encoded_once_and_its_waiters_get_the_result() -> None:
    async def run() -> tuple[list[object], int]:
        flights = SingleFlight()
        encodes = 0

        async def request() -> object:
            nonlocal encodes
            flight = await flights.join("key")
            if flight is not None:
                return await flight
            encodes += 1
            await asyncio.sleep(0.05)
            flights.land("key", ("h", "param"))
            return ("h", "param")

        results = await asyncio.gather(*(request() for _ in range(5)))
        # Landed: the next request with the key leads a flight of its own.
        assert await flights.join("key") is None
        return list(results), encodes

    results, encodes = asyncio.run(run())
    assert encodes == 1
    assert results == [("h", "param")] * 5


def test_a_failed_flight_hands_its_waiters_nothing() -> None:
    async def run() -> object:
        flights = SingleFlight()
        assert await flights.join("key") is None
        waiter = await flights.join("key")
        assert waiter is not None
        flights.land("key", None)
        return await waiter

    assert asyncio.run(run()) is None


# -- the ec_transfer_params schema --------------------------------------------------------------

ITEM = {
    "peer": "tcp://10.0.0.5:5701",
    "fingerprint": "f" * 32,
    "nbytes": 4096,
    "dtype": "bfloat16",
    "shape": [32, 64],
    "modality": "image",
    "metadata": {"image_grid_thw": [1, 8, 16]},
    "item_indices": [0, 2],
    "pushed_to": ["pd0"],
}


def test_item_params_round_trip_through_json() -> None:
    items = decode_items({"h1": ITEM})
    assert items["h1"].shape == (32, 64) and items["h1"].pushed_to == ("pd0",)
    assert msgspec.json.decode(msgspec.json.encode(items)) == {"h1": ITEM}
    # vLLM 0.32's shape: no modality, metadata or indices.
    bare = {k: ITEM[k] for k in ("peer", "fingerprint", "nbytes", "dtype", "shape")}
    found = decode_items({"h": bare})["h"]
    assert found == TransferParam(**{**bare, "shape": (32, 64)})  # type: ignore[arg-type]
    assert found.metadata is None and found.item_indices == ()


@pytest.mark.parametrize(
    "bad",
    [
        {"h": {**ITEM, "region_address": 140000000}},  # unknown: never learned from params
        {"h": {**ITEM, "nbytes": -1}},
        {"h": {**ITEM, "shape": [1] * 9}},
        {"h": {**ITEM, "pushed_to": ["no spaces allowed"]}},
        {"h": {**ITEM, "pushed_to": [f"pd{i}" for i in range(9)]}},
        {"h": {**ITEM, "item_indices": [-1]}},
        {"h": "not an object"},
        {"": ITEM},
        ["not", "a", "map"],
    ],
    ids=[
        "unknown_field",
        "negative_size",
        "too_many_dims",
        "bad_push_name",
        "too_many_push_names",
        "negative_index",
        "item_not_object",
        "empty_hash",
        "not_a_map",
    ],
)
def test_malformed_or_unknown_params_are_a_params_error(bad: object) -> None:
    with pytest.raises(ParamsError):
        decode_items(bad)


def test_a_push_request_names_at_most_eight_valid_names() -> None:
    assert decode_push_request({"push_to": ["pd0", "pd1"]}).push_to == ("pd0", "pd1")
    assert decode_push_request({}).push_to == ()
    for bad in ({"push_to": "pd0"}, {"push_to": [f"p{i}" for i in range(9)]}, ["pd0"]):
        with pytest.raises(ParamsError):
            decode_push_request(bad)
