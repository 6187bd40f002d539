"""A Release rides with the next message to its producer, and never holds up a grant.

Releases of finished grants wait (up to `RELEASE_DELAY_S`) for the next
FetchRequest or heartbeat and go out right after it, so that the producer wakes
once for both and answers the request first. Once a producer refuses for load,
the link's Releases go out at once and ahead of each request, so that the
session's limits there see them first. A Release goes only on the session its
grant was made on: one of a session since replaced is never sent.
"""

from __future__ import annotations

import time
from typing import Any

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer.link import RELEASE_DELAY_S, PeerLink, PeerLinkState


class _Wire:
    """Stands in for the link's control client: keeps what is sent, in order."""

    def __init__(self) -> None:
        self.sent: list[p.Message] = []

    def send(self, message: p.Message) -> bool:
        self.sent.append(message)
        return True


def _ready_link(ended: list[str] | None = None) -> tuple[PeerLink, _Wire]:
    link = PeerLink(
        "tcp://127.0.0.1:1",
        config=Config(insecure=True),
        pool=Any,  # type: ignore[arg-type]  # never reached: the link is made READY by hand
        transport=Any,  # type: ignore[arg-type]
        hello=lambda session_id: p.Hello(
            versions=[2], session_id=session_id, client_name="t", fingerprint="f"
        ),
        ended=lambda link: (ended if ended is not None else []).append(link.session_id),
    )
    wire = _Wire()
    link.client = wire  # type: ignore[assignment]
    link.session_id = "s1"
    link.state = PeerLinkState.READY
    link._next_ping = time.monotonic() + 3600  # as a Welcome would set it: no ping due
    return link, wire


def _kinds(wire: _Wire) -> list[str]:
    return [type(m).__name__ for m in wire.sent]


def test_release_waits_for_the_next_request_and_goes_out_after_it() -> None:
    link, wire = _ready_link()
    link.release(["g1"], "s1")
    assert not link.releases_due(time.monotonic())  # just queued
    assert wire.sent == []

    link.request("r2", [p.ItemRequest("next")], [], 0.0)

    assert _kinds(wire) == ["FetchRequest", "Release"]
    assert wire.sent[1] == p.Release(session_id="s1", grant_ids=["g1"])


def test_a_lone_release_is_due_after_the_delay_and_wakes_the_loop_then() -> None:
    link, _ = _ready_link()
    before = time.monotonic()
    link.release(["g1"], "s1")
    due_at = link.next_deadline(time.monotonic())  # the loop sleeps until then at the latest
    assert before + RELEASE_DELAY_S <= due_at <= time.monotonic() + RELEASE_DELAY_S
    assert link.releases_due(due_at)
    assert not link.releases_due(due_at - RELEASE_DELAY_S / 2)


def test_after_a_refusal_for_load_releases_go_at_once_and_ahead_of_requests() -> None:
    link, wire = _ready_link()
    link.release(["g1"], "s1")
    link.releases_ahead()  # what the consumer does on OVERLOADED
    assert _kinds(wire) == ["Release"]

    link.release(["g2"], "s1")
    assert link.releases_due(0.0)
    link.request("r3", [p.ItemRequest("next")], [], 0.0)
    assert _kinds(wire) == ["Release", "Release", "FetchRequest"]


def test_closing_the_link_sends_queued_releases_before_bye() -> None:
    link, wire = _ready_link()
    link.release(["g1"], "s1")
    pool = type("Pool", (), {"close": lambda self, endpoint: None})()
    link._pool = pool  # type: ignore[assignment]
    link.close()
    assert _kinds(wire) == ["Release", "Bye"]


def test_with_the_capability_releases_ride_inside_the_next_request() -> None:
    link, wire = _ready_link()
    link.releases_in_request = True  # as a Welcome listing CAP_RELEASE_IN_REQUEST sets it
    link.release(["g1", "g2"], "s1")

    link.request("r2", [p.ItemRequest("next")], [], 0.0)

    # One message, not two: the producer releases them before it grants, unanswered.
    assert wire.sent == [
        p.FetchRequest(
            session_id="s1", request_id="r2", items=[p.ItemRequest("next")], releases=["g1", "g2"]
        )
    ]
    link.request("r3", [p.ItemRequest("after")], [], 0.0)
    assert wire.sent[1] == p.FetchRequest(
        session_id="s1", request_id="r3", items=[p.ItemRequest("after")]
    )


def test_releases_beyond_one_message_follow_the_request_that_carries_the_first() -> None:
    link, wire = _ready_link()
    link.releases_in_request = True
    grants = [f"g{i}" for i in range(p.MAX_BATCH_ITEMS + 3)]
    link.release(grants, "s1")

    link.request("r2", [p.ItemRequest("next")], [], 0.0)

    assert _kinds(wire) == ["FetchRequest", "Release"]
    request, rest = wire.sent
    assert isinstance(request, p.FetchRequest) and isinstance(rest, p.Release)
    assert request.releases == grants[: p.MAX_BATCH_ITEMS]
    assert rest.grant_ids == grants[p.MAX_BATCH_ITEMS :]


def test_after_a_refusal_for_load_releases_in_requests_still_come_first() -> None:
    link, wire = _ready_link()
    link.releases_in_request = True
    link.release(["g1"], "s1")
    link.releases_ahead()  # what is queued goes at once, as without the capability
    assert _kinds(wire) == ["Release"]

    link.release(["g2"], "s1")
    link.request("r3", [p.ItemRequest("next")], [], 0.0)
    # In the request: released before its grants, which is what "ahead" is for.
    assert _kinds(wire) == ["Release", "FetchRequest"]
    assert isinstance(wire.sent[1], p.FetchRequest) and wire.sent[1].releases == ["g2"]


def test_releases_in_a_request_that_times_out_go_again_with_the_next_message() -> None:
    link, wire = _ready_link()
    link.releases_in_request = True
    link.release(["g1"], "s1")
    link.request("r2", [p.ItemRequest("lost")], [], 0.0)
    link.request("r3", [p.ItemRequest("answered")], [], 0.0)
    link.answered("r3")

    # r2 is never answered: it may never have arrived, and g1 with it.
    expired = link.expired_requests(link._config.request_timeout_s + 1.0)
    assert [rid for rid, _ in expired] == ["r2"]
    link.request("r4", [p.ItemRequest("next")], [], 0.0)
    request = wire.sent[-1]
    assert isinstance(request, p.FetchRequest) and request.releases == ["g1"]
    # Once a request carrying them is answered, they are not sent again.
    link.answered("r4")
    assert link.expired_requests(1e9) == []
    link.request("r5", [p.ItemRequest("after")], [], 0.0)
    last = wire.sent[-1]
    assert isinstance(last, p.FetchRequest) and last.releases == []


def _sent_releases(wire: _Wire, session_id: str) -> list[str]:
    """Every grant id released on `session_id`, in Releases or inside requests."""
    out: list[str] = []
    for m in wire.sent:
        if isinstance(m, p.Release) and m.session_id == session_id:
            out += m.grant_ids
        if isinstance(m, p.FetchRequest) and m.session_id == session_id:
            out += m.releases
    return out


def test_releases_of_a_replaced_session_never_go_out_on_the_new_one() -> None:
    """The producer restarted (NO_SESSION): Releases queued, carried in an unanswered
    request, or made later for the old session's grants are dropped, not sent on the
    new session, where the same ids may name the new process's live grants."""
    link, wire = _ready_link()
    link.releases_in_request = True
    link.release(["g1"], "s1")
    link.request("r2", [p.ItemRequest("lost")], [], 0.0)  # carries g1; never answered
    link.release(["g2"], "s1")  # queued
    assert link.on_message(p.Error(code=p.ErrorCode.NO_SESSION, message="gone"), 0.0) is None
    assert link.state is PeerLinkState.IDLE
    link.connect(0.0)
    new = link.session_id
    assert new != "s1"
    link.state = PeerLinkState.READY  # welcomed
    link._next_ping = time.monotonic() + 3600

    assert [rid for rid, _ in link.expired_requests(link._config.request_timeout_s + 1.0)] == ["r2"]
    link.release(["g3"], "s1")  # a read of the old session that ended just now
    link.request("r4", [p.ItemRequest("next")], [], 0.0)
    link.flush_releases()

    assert _sent_releases(wire, new) == []
    assert link.answered("r2") == ""  # a late answer's grants are not the new session's
    link.release(["g9"], new)
    link.flush_releases()
    assert _sent_releases(wire, new) == ["g9"]


def test_every_way_a_session_ends_is_told_once() -> None:
    ended: list[str] = []
    link, _wire = _ready_link(ended)
    assert link.on_message(p.Error(code=p.ErrorCode.NO_SESSION, message="gone"), 0.0) is None
    link.connect(0.0)  # a new handshake: the old session was told already
    assert ended == ["s1"]
    second = link.session_id
    link.state = PeerLinkState.READY
    link.connect(0.0)  # not IDLE: nothing happens
    link.client = None  # closed with no socket to close (the pool is a stand-in here)
    link.close()
    link.close()
    assert ended == ["s1", second]
