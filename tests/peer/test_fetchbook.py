"""The fetch book alone: no sockets, no data plane, no clock (`ecshare.peer.fetchbook`).

Each test drives the book as the consumer's loop does, telling it what happened and
asking it what is due, and checks the promise the loop relies on."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ecshare import protocol as p
from ecshare.errors import IllegalTransition
from ecshare.peer.fetchbook import FetchBook
from ecshare.peer.machine import Transitions
from ecshare.peer.transfer import (
    DirectRead,
    FailureReason,
    FetchResult,
    GrantedRead,
    Transfer,
    TransferState,
    lease_margin,
)


def _transfer(
    mm_hash: str = "a", peers: tuple[str, ...] = ("p1",), deadline: float = 10.0
) -> Transfer:
    return Transfer(
        mm_hash=mm_hash,
        future=Future[FetchResult](),
        candidates=list(peers),
        started=0.0,
        deadline=deadline,
    )


def _booked(*transfers: Transfer) -> FetchBook:
    book = FetchBook()
    with book.lock:
        for t in transfers:
            book.add(t)
    assert book.take_incoming() == list(transfers)
    return book


def test_a_second_fetch_of_an_item_in_flight_finds_the_first() -> None:
    book = FetchBook()
    first = _transfer("a")
    with book.lock:
        assert book.running("a") is None
        book.add(first)
        assert book.running("a") is first
    assert book.pending() == 1


def test_fetches_leave_the_queue_once_and_in_order() -> None:
    book = FetchBook()
    a, b = _transfer("a"), _transfer("b")
    with book.lock:
        book.add(a)
        book.add(b)
    assert book.take_incoming() == [a, b]
    assert book.take_incoming() == []
    assert book.transfers == [a, b]


def test_a_finished_fetch_leaves_the_table_and_the_single_flight_index() -> None:
    a = _transfer("a")
    book = _booked(a)
    book.finish(a)
    assert book.transfers == [] and book.pending() == 0
    with book.lock:
        assert book.running("a") is None


def test_a_stranded_fetch_is_handed_back_at_shutdown() -> None:
    book = FetchBook()
    a = _transfer("a")
    with book.lock:
        book.add(a)
    assert book.take_stranded() == [a]
    assert book.take_incoming() == []


def test_only_queued_fetches_past_their_backoff_are_due() -> None:
    a, b, c = _transfer("a"), _transfer("b"), _transfer("c")
    b.not_before = 5.0
    book = _booked(a, b, c)
    book.ask([c], "r1", "s1", now=0.0)
    assert book.due(1.0) == [a]
    assert book.due(5.0) == [a, b]


def test_a_request_makes_a_granted_read_with_its_lease_counted_from_the_send() -> None:
    t = _transfer()
    book = _booked(t)
    book.ask([t], "r1", "s1", now=2.0)
    assert t.state is TransferState.REQUESTED and t.attempts == 1
    g = book.grant(t, "g1", lease_s=4.0)
    assert isinstance(t.read, GrantedRead) and t.direct is None
    assert (g.request_id, g.session_id, g.grant_id) == ("r1", "s1", "g1")
    assert (g.lease_end, g.renew_at) == (6.0, 4.0)
    assert t.give_up_at() == 6.0 - lease_margin(4.0)


def test_a_direct_read_goes_from_queued_to_reading_without_a_request_or_grant() -> None:
    t = _transfer()
    t.read = DirectRead(tag=7, tag_offset=64)
    t.move(TransferState.READING)
    assert t.granted is None and t.direct is not None
    assert t.give_up_at() == t.deadline  # no lease bounds it


def test_only_a_direct_read_skips_the_request() -> None:
    t = _transfer()
    with pytest.raises(IllegalTransition):
        t.move(TransferState.READING)
    t.read = GrantedRead("r1", "s1", 0.0)
    with pytest.raises(IllegalTransition):
        t.move(TransferState.READING)
    assert t.state is TransferState.QUEUED


def test_a_retryable_refusal_backs_off_exponentially_then_gives_up() -> None:
    t = _transfer()
    book = _booked(t)
    waits = []
    for _ in range(3):
        book.ask([t], "r", "s", now=0.0)
        assert FetchBook.back_off(t, 10.0, 0.0, retries=3, first_s=0.1, max_s=0.3)
        waits.append(round(t.not_before - 10.0, 6))
    assert waits == [0.1, 0.2, 0.3]
    book.ask([t], "r", "s", now=0.0)
    assert not FetchBook.back_off(t, 10.0, 0.0, retries=3, first_s=0.1, max_s=0.3)


def test_a_peers_retry_after_outlasts_the_backoff() -> None:
    t = _transfer()
    book = _booked(t)
    book.ask([t], "r", "s", now=0.0)
    assert FetchBook.back_off(t, 10.0, 2.0, retries=3, first_s=0.1, max_s=0.3)
    assert t.not_before == 12.0


def test_failing_over_clears_the_attempt_and_moves_to_the_next_peer() -> None:
    t = _transfer(peers=("p1", "p2"))
    book = _booked(t)
    book.ask([t], "r", "s", now=0.0)
    book.grant(t, "g", 1.0)
    t.remote_extents = [(0, 8)]
    assert FetchBook.fail_over(t, FailureReason.TRANSPORT)
    assert (t.state, t.peer, t.read, t.remote_extents) == (TransferState.QUEUED, "p2", None, [])
    assert not FetchBook.fail_over(t, FailureReason.MISSING)
    assert t.final_reason() is FailureReason.TRANSPORT  # the more telling of the two


def test_a_missed_direct_read_asks_the_same_peer() -> None:
    t = _transfer(peers=("p1", "p2"))
    t.read = DirectRead()
    t.direct_tried = True
    t.move(TransferState.READING)
    FetchBook.ask_instead(t)
    assert (t.state, t.peer, t.read, t.direct_tried) == (TransferState.QUEUED, "p1", None, True)


def test_deadlines_and_lease_margins_expire_separately() -> None:
    late, reading, fresh = _transfer("late", deadline=1.0), _transfer("r"), _transfer("f")
    book = _booked(late, reading, fresh)
    book.ask([reading], "r", "s", now=0.0)
    book.grant(reading, "g", lease_s=2.0)
    reading.move(TransferState.READING)  # its READ is in flight
    assert book.expired(1.0) == ([late], [])
    assert book.expired(2.0 - lease_margin(2.0)) == ([late], [reading])


def test_renewals_are_due_half_way_and_only_once() -> None:
    t = _transfer(deadline=100.0)
    book = _booked(t)
    book.ask([t], "r", "s", now=0.0)
    g = book.grant(t, "g", lease_s=4.0)
    t.move(TransferState.READING)
    assert book.renewals_due(1.9) == {}
    assert book.renewals_due(2.0) == {"p1": [t]}
    g.renew_sent = 2.0
    assert book.renewals_due(3.0) == {}


def test_a_renewal_counts_from_when_it_was_asked_and_a_refusal_keeps_the_old_lease() -> None:
    a, b = _transfer("a", deadline=100.0), _transfer("b", deadline=100.0)
    book = _booked(a, b)
    book.ask([a, b], "r", "s", now=0.0)
    ga, gb = book.grant(a, "ga", 4.0), book.grant(b, "gb", 4.0)
    ga.renew_sent = gb.renew_sent = 2.0
    assert book.renewed("p1", frozenset({"ga", "gb"}), {"ga"}, 4.0) == (1, 1)
    assert (ga.lease_end, ga.renew_sent) == (6.0, 0.0)
    assert (gb.lease_end, gb.renew_at) == (4.0, math.inf)


def test_an_answer_for_another_peer_renews_nothing() -> None:
    t = _transfer(deadline=100.0)
    book = _booked(t)
    book.ask([t], "r", "s", now=0.0)
    g = book.grant(t, "g", 4.0)
    g.renew_sent = 2.0
    assert book.renewed("p2", frozenset({"g"}), {"g"}, 4.0) == (0, 0)
    assert g.lease_end == 4.0


def test_describe_takes_size_meta_and_extents_and_scales_the_deadline() -> None:
    t = _transfer(deadline=1.0)
    item = p.ItemReply(
        mm_hash="a",
        status=p.ItemStatus.GRANTED,
        nbytes=16,
        dtype="uint8",
        shape=[16],
        checksum=5,
        extents=[p.Extent(0, 8), p.Extent(64, 8)],
    )
    FetchBook.describe(t, item, deadline_s=3.0)
    assert (t.nbytes, t.dtype, t.shape, t.checksum) == (16, "uint8", (16,), 5)
    assert t.remote_extents == [(0, 8), (64, 8)] and t.deadline == 3.0


_STATES = list(TransferState)


@given(st.lists(st.sampled_from(_STATES), max_size=12))
def test_no_sequence_of_moves_leaves_the_diagram(moves: list[TransferState]) -> None:
    """Whatever is asked, a transfer is only ever in a state the diagram reaches, and a
    refused move changes nothing."""
    t = _transfer()
    for new in moves:
        old = t.state
        try:
            t.move(new)
        except IllegalTransition:
            assert t.state is old
            continue
        assert old not in (TransferState.DONE, TransferState.FAILED)
        assert not (old is TransferState.QUEUED and new is TransferState.GRANTED)


def test_a_state_missing_from_a_table_is_final() -> None:
    moves = Transitions({TransferState.QUEUED: (TransferState.DONE,)})
    assert moves.allows(TransferState.QUEUED, TransferState.DONE)
    with pytest.raises(IllegalTransition, match="x: done -> queued"):
        moves.check("x", TransferState.DONE, TransferState.QUEUED)
