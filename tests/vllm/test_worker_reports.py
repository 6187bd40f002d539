"""The side channel that carries an encode-only instance's worker reports (`ecshare.vllm.reports`).

vLLM's V1 runner drops the EC connector output of an encode-only step, so
without this channel no encoder output would ever become READY.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ecshare.vllm.ops import ReportRoute, StepReport
from ecshare.vllm.reports import ReportInbox, ReportListener, ReportOutbox


@pytest.fixture
def inbox() -> Iterator[ReportInbox]:
    box = ReportInbox()
    try:
        yield box
    finally:
        box.close()


def report() -> StepReport:
    return StepReport(
        saved={"save-1": ("float32", (12, 128))},
        save_failed={"save-2": "out of memory"},
        loaded={"probe-3"},
        counters={"save_seconds": 0.25},
    )


def test_worker_report_reaches_the_scheduler_side(inbox: ReportInbox) -> None:
    outbox = ReportOutbox(inbox.route)
    try:
        outbox.send(report())
        assert inbox.receive(timeout_s=5.0) == [report()]
        assert inbox.receive() == []
    finally:
        outbox.close()


def test_report_without_the_plans_token_is_dropped(inbox: ReportInbox) -> None:
    forged = ReportOutbox(ReportRoute(inbox.route.address, b"\0" * 16))
    honest = ReportOutbox(inbox.route)
    try:
        forged.send(report())
        honest.send(StepReport(loaded={"ok"}))
        received: list[StepReport] = []
        for _ in range(50):
            received += inbox.receive(timeout_s=0.1)
            if received and inbox.dropped:
                break
        assert received == [StepReport(loaded={"ok"})]
        assert inbox.dropped == 1
    finally:
        forged.close()
        honest.close()


def test_malformed_report_is_dropped(inbox: ReportInbox) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    try:
        sock.connect(inbox.route.address)
        sock.send_multipart([inbox.route.token, b"\xc1 not msgpack"])
        sock.send_multipart([b"one frame only"])
        for _ in range(50):
            assert inbox.receive(timeout_s=0.1) == []
            if inbox.dropped == 2:
                break
        assert inbox.dropped == 2
    finally:
        sock.close(linger=0)
        context.term()


def test_grant_one_rank_failed_to_load_is_not_reported_loaded() -> None:
    # With tensor parallelism vLLM merges every rank's report into one.
    rank0 = StepReport(loaded={"probe-1", "probe-2"}, counters={"load_seconds": 0.5})
    rank1 = StepReport(loaded={"probe-1"}, load_failed={"probe-2": "bad extents"})
    merged = rank0.merge(rank1)
    assert merged.loaded == {"probe-1"}
    assert merged.load_failed == {"probe-2": "bad extents"}
    assert merged.counters == {"load_seconds": 0.5}


def _wakes(thread: threading.Thread) -> int:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_idle_listener_sleeps_until_a_report_or_close() -> None:
    applied: list[StepReport] = []
    listener = ReportListener(applied.append)
    outbox = ReportOutbox(listener.route)
    try:
        outbox.send(report())
        deadline = time.monotonic() + 10
        while not applied and time.monotonic() < deadline:
            time.sleep(0.01)
        assert applied == [report()]  # the loop ran
        (thread,) = [t for t in threading.enumerate() if t.name == "ecshare-reports"]
        before = _wakes(thread)
        time.sleep(1.0)
        # A listener that polled on a tick would have woken about ten times.
        assert _wakes(thread) - before <= 2
    finally:
        outbox.close()
        listener.close()
    assert not thread.is_alive()  # close() woke it
