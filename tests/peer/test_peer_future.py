"""A fetch's future (`_Fetching`) keeps every promise of a `concurrent.futures.Future`
while making its condition only when someone may wait on it.

The fetch's network thread (or the caller it lends to) ends the future; any other
thread may wait on it in any of the ways the standard library offers. These tests
end futures from one thread while others wait in each of those ways, and check
that every waiter is woken with the outcome, that a callback runs exactly once,
and that a future ended with no one waiting never made a condition at all.
No consumer is needed: the future's owner here never lends (a fetch whose owner
is gone lends nothing, as in a consumer that has stopped).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, as_completed, wait

import pytest

from ecshare.peer import FailureReason, FetchFailed, FetchResult
from ecshare.peer.lending import Fetching as _Fetching

pytestmark = pytest.mark.timeout(60)


class _Gone:
    """An owner that is collected at once: the future lends to no one."""


def _future() -> _Fetching:
    return _Fetching(weakref.ref(_Gone()))


def _result(h: str) -> FetchResult:
    return FetchResult(h, 1, "uint8", (1,), "peer", 0.001, 0)


def test_a_future_ended_with_no_one_waiting_never_makes_a_condition() -> None:
    future = _future()
    assert future.running() is True  # running() takes the condition: a fresh future
    plain = _future()
    plain.set_result(_result("a"))
    assert "_cond" not in plain.__dict__
    assert plain.result() == _result("a")  # the lock-free answer of an ended fetch
    assert "_cond" not in plain.__dict__
    assert plain.done() and not plain.cancel()  # the usual answers, a condition made now
    failed = _future()
    failed.set_exception(FetchFailed("b", FailureReason.MISSING))
    assert "_cond" not in failed.__dict__
    with pytest.raises(FetchFailed):
        failed.result()


def test_a_future_ends_once() -> None:
    future = _future()
    future.set_result(_result("a"))
    with pytest.raises(InvalidStateError):
        future.set_result(_result("b"))
    with pytest.raises(InvalidStateError):
        future.set_exception(FetchFailed("a", FailureReason.MISSING))
    assert future.result() == _result("a")


def test_a_running_fetch_cannot_be_cancelled() -> None:
    future = _future()
    assert not future.cancel() and not future.cancelled()
    future.set_result(_result("a"))
    assert future.result() == _result("a")


@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_every_kind_of_waiter_is_woken_by_the_thread_that_ends_the_fetch(outcome: str) -> None:
    """Waiters of each kind (a blocking result(), exception(), wait(), as_completed(),
    a done-callback, an asyncio task) are all in place before the end comes from
    another thread, and every one sees it."""
    future = _future()
    seen: dict[str, object] = {}
    calls: list[str] = []
    future.add_done_callback(lambda f: calls.append("early"))
    started = threading.Barrier(6)

    def blocking_result() -> None:
        started.wait()
        try:
            seen["result"] = future.result(timeout=20)
        except FetchFailed as exc:
            seen["result"] = exc

    def blocking_exception() -> None:
        started.wait()
        seen["exception"] = future.exception(timeout=20)

    def waiting() -> None:
        started.wait()
        done, _ = wait([future], timeout=20, return_when=FIRST_COMPLETED)
        seen["wait"] = done == {future}

    def completing() -> None:
        started.wait()
        seen["as_completed"] = list(as_completed([future], timeout=20)) == [future]

    def in_asyncio() -> None:
        async def main() -> object:
            started.wait()
            try:
                return await asyncio.wait_for(asyncio.wrap_future(future), 20)
            except FetchFailed as exc:
                return exc

        seen["asyncio"] = asyncio.run(main())

    threads = [
        threading.Thread(target=f)
        for f in (blocking_result, blocking_exception, waiting, completing, in_asyncio)
    ]
    for t in threads:
        t.start()
    started.wait()
    # The waiters get to their waits: each has made or found the one condition.
    for _ in range(200):
        if len(future._waiters) == 2 and len(future._done_callbacks) == 2:
            break
        threading.Event().wait(0.005)
    assert len(future._waiters) == 2, "wait() and as_completed() are waiting"
    error = FetchFailed("h", FailureReason.TRANSPORT, "test")
    if outcome == "result":
        future.set_result(_result("h"))
    else:
        future.set_exception(error)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    future.add_done_callback(lambda f: calls.append("late"))
    assert calls == ["early", "late"]  # each once: before the end, and at once after it
    expected = _result("h") if outcome == "result" else error
    assert seen["result"] == expected and seen["asyncio"] == expected
    assert seen["exception"] is (None if outcome == "result" else error)
    assert seen["wait"] is True and seen["as_completed"] is True


def test_waiters_racing_the_end_are_never_left_waiting() -> None:
    """Thousands of fetches, each ended by one thread while another starts waiting on
    it at the same moment (some before the end, some after, some in between): every
    wait returns the outcome, none runs into its timeout."""
    n = 3000
    futures = [_future() for _ in range(n)]
    go = [threading.Event() for _ in range(n)]
    late: list[int] = []

    def ender() -> None:
        for i, f in enumerate(futures):
            go[i].wait(10)
            f.set_result(_result(str(i)))

    t = threading.Thread(target=ender)
    t.start()
    for i, f in enumerate(futures):
        go[i].set()
        kind = i % 3
        if kind == 0:
            got = f.result(timeout=10)
        elif kind == 1:
            done, _ = wait([f], timeout=10)
            got = f.result(timeout=0) if done else None
        else:
            box: list[Future[FetchResult]] = []
            ev = threading.Event()
            f.add_done_callback(lambda x, b=box, e=ev: (b.append(x), e.set()))
            got = f.result(timeout=0) if ev.wait(10) else None
        if got != _result(str(i)):
            late.append(i)
    t.join(timeout=30)
    assert late == []
