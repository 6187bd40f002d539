"""Engine threads can rouse the network thread's poller, and no wake-up is lost."""

from __future__ import annotations

import queue
import threading
import time

import zmq

from ecshare.control import Waker


def _readable(poller: zmq.Poller, waker: Waker, timeout_ms: int) -> bool:
    ready = dict(poller.poll(timeout_ms))
    return waker in ready or waker.fileno() in ready


def test_waker_wakes_a_poller_from_another_thread() -> None:
    with Waker() as waker:
        poller = zmq.Poller()
        poller.register(waker, zmq.POLLIN)
        assert not _readable(poller, waker, 0)
        timer = threading.Timer(0.05, waker.wake)
        started = time.monotonic()
        timer.start()
        assert _readable(poller, waker, 10_000)
        assert time.monotonic() - started < 5
        timer.join()
        waker.clear()
        assert not _readable(poller, waker, 0)


def test_many_wakes_coalesce_into_one_clear() -> None:
    with Waker() as waker:
        poller = zmq.Poller()
        poller.register(waker, zmq.POLLIN)
        for _ in range(10_000):
            waker.wake()
        assert _readable(poller, waker, 1_000)
        waker.clear()
        assert not _readable(poller, waker, 0)


def test_no_wake_up_is_lost_between_threads() -> None:
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    senders, per_sender = 4, 500
    seen: list[int] = []
    with Waker() as waker:
        poller = zmq.Poller()
        poller.register(waker, zmq.POLLIN)

        def engine(base: int) -> None:
            for i in range(per_sender):
                work.put(base + i)  # enqueue, then wake: the documented order
                waker.wake()

        threads = [threading.Thread(target=engine, args=(n * per_sender,)) for n in range(senders)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(seen) < senders * per_sender and time.monotonic() < deadline:
            if _readable(poller, waker, 1_000):
                waker.clear()  # clear, then drain: the documented order
                while True:
                    try:
                        seen.append(work.get_nowait())
                    except queue.Empty:
                        break
        for thread in threads:
            thread.join()
    assert sorted(seen) == list(range(senders * per_sender))


def test_wake_and_close_after_close_are_harmless() -> None:
    waker = Waker()
    waker.close()
    waker.wake()
    waker.clear()
    waker.close()
