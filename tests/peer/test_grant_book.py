"""The producer's grant book alone: a real store, no sockets, no thread (`ecshare.peer.grants`).

Each test drives the book as the producer's loop does, with requests and notices,
and checks the promise the loop relies on: a pin per grant, never two for one
request, and never an end of someone else's grant.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.counts import Counts
from ecshare.peer.grants import Grants, Session, pin_owner
from ecshare.store import Region, Store

BLOCK = 4096


class FakeClock:
    """The store's clock, moved by hand, so that a lease ends exactly when a test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Book:
    def __init__(self, store: Store, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.counts = Counts()
        self.config = Config.from_dict({})
        self.sessions: dict[str, Session] = {}
        self.grants = Grants(
            store,
            self.config,
            lock=threading.Lock(),
            find=self.sessions.get,
            count=self.counts.add,
        )

    def session(self, session_id: str, agent: str = "agent") -> Session:
        session = Session(session_id, "", b"route", "client", agent, 2, 0.0)
        self.sessions[session_id] = session
        return session

    def past_the_lease(self) -> None:
        self.clock.now += self.config.grant_lease_s + 1.0

    def pins(self) -> int:
        return self.store.stats().pins


@pytest.fixture
def book() -> Iterator[Book]:
    with Region.create(64 * BLOCK, name="ecshare-test-grant-book") as region:
        clock = FakeClock()
        store = Store(region, BLOCK, clock=clock)
        for name in ("a", "b"):
            store.put(name, np.zeros(3 * BLOCK, dtype=np.uint8))
        yield Book(store, clock)


def _request(request_id: str, *names: str) -> p.FetchRequest:
    return p.FetchRequest(
        session_id="s", request_id=request_id, items=[p.ItemRequest(mm_hash=n) for n in names]
    )


def _granted(reply: p.Message) -> list[p.ItemReply]:
    assert isinstance(reply, p.FetchReply), reply
    assert all(item.status is p.ItemStatus.GRANTED for item in reply.items), reply
    return reply.items


def test_repeated_request_returns_the_same_grants_and_never_pins_twice(book: Book) -> None:
    session = book.session("s")
    first = _granted(book.grants.fetch(session, _request("r1", "a", "b")))
    assert book.pins() == 2
    again = _granted(book.grants.fetch(session, _request("r1", "a", "b")))
    assert [i.grant_id for i in again] == [i.grant_id for i in first]
    assert book.pins() == 2 and book.counts["duplicate_requests"] == 1


def test_release_ends_only_the_sessions_own_grants(book: Book) -> None:
    mine, theirs = book.session("s"), book.session("t")
    (grant,) = _granted(book.grants.fetch(mine, _request("r1", "a")))
    assert book.grants.release(theirs, [grant.grant_id, "g1.another-epoch"]) == []
    assert book.counts["releases_unmatched"] == 2
    assert book.store.pinned_entry(pin_owner("s"), grant.grant_id) is not None
    assert book.grants.release(mine, [grant.grant_id]) == [grant.grant_id]
    assert book.pins() == 0 and mine.grants == {}


def test_notice_from_another_agent_releases_nothing(book: Book) -> None:
    session = book.session("s", agent="consumer-agent")
    (grant,) = _granted(book.grants.fetch(session, _request("r1", "a")))
    note = f"s:{grant.grant_id}".encode()
    book.grants.on_notification("forger", note)
    book.grants.on_notification("consumer-agent", b"\xff not ascii")
    assert book.counts["bad_notifications"] == 2 and book.pins() == 1
    book.grants.on_notification("consumer-agent", note)
    assert book.pins() == 0 and book.counts["released"] == 1


def test_ended_grant_is_never_replayed_from_the_cache(book: Book) -> None:
    session = book.session("s")
    (grant,) = _granted(book.grants.fetch(session, _request("r1", "a")))
    book.past_the_lease()
    book.grants.reap()
    assert book.pins() == 0 and book.counts["leases_expired"] == 1 and session.grants == {}
    reply = book.grants.fetch(session, _request("r1", "a"))
    assert isinstance(reply, p.FetchReply)
    (item,) = reply.items
    assert item.status is p.ItemStatus.MISSING and not item.extents
    assert grant.grant_id in item.detail
    assert book.pins() == 0


def test_ended_session_leaves_its_grants_to_their_leases(book: Book) -> None:
    session = book.session("s")
    (grant,) = _granted(book.grants.fetch(session, _request("r1", "a")))
    assert book.grants.end(session, keep_leases=True) == [grant.grant_id]
    assert book.grants.lingering == {(pin_owner("s"), grant.grant_id)} and book.pins() == 1
    book.past_the_lease()
    book.grants.reap()
    assert book.grants.lingering == set() and book.pins() == 0
