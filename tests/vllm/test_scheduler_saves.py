"""The producer's saves, in real vLLM Schedulers of encode-only instances (see conftest.py).

A finished request never waits for its workers' report; a report is applied
the moment it arrives, engine step or not, and only to the save it names; and
an item the engine served from its own encoder cache is stored and announced
again when the region had lost it. Reports travel on the real side channel
(`ecshare.vllm.reports`), as they do from vLLM's workers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import EC, embedding
from waiting import wait_until

from ecshare.config import Config
from ecshare.store import Entry, EntryMeta, EntryState, Region, Store
from ecshare.vllm import saves
from ecshare.vllm.ops import StepPlan, StepReport
from ecshare.vllm.reports import ReportOutbox
from ecshare.vllm.saves import SaveBook
from ecshare.vllm.tally import Tally


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def stored(store: Store, entry: Entry) -> bytes:
    return b"".join(bytes(v) for v in store.views(entry))


Send = Callable[[StepPlan, StepReport], None]


@pytest.fixture
def send() -> Iterator[Send]:
    """Sends a report where a plan tells the workers to, as a worker does: from an outbox
    kept open until the test ends (a worker's lives as long as it does), so that ZMQ has
    connected and handed the report on whatever the load."""
    opened: list[ReportOutbox] = []

    def send_(plan: StepPlan, report: StepReport) -> None:
        assert plan.report_to is not None
        outbox = ReportOutbox(plan.report_to)
        opened.append(outbox)
        outbox.send(report)

    yield send_
    for outbox in opened:
        outbox.close()


SAVE_REPORT_TIMEOUT_S = 30.0


def test_finished_request_never_waits_for_a_late_report(ec: EC, send: Send) -> None:
    producer = ec.scheduler(
        "ec_producer", request_timeout_s=2.0, save_report_timeout_s=SAVE_REPORT_TIMEOUT_S
    )
    store = ec.side(producer).store
    emb = embedding()
    producer.add_request(ec.request("p1", "h-late", max_tokens=1))
    step = ec.step(producer, {"h-late": emb}, report=False)
    late = ec.worker(producer).take_report()  # the report is late: still on its way
    assert late is not None

    started = time.monotonic()
    ec.finish_step(producer, step)  # the request finishes now
    elapsed = time.monotonic() - started

    # The report comes only after this returns: a scheduler waiting for it would wait
    # until it gave the save up, at save_report_timeout_s (the grace it may take is a
    # tenth of a second).
    assert elapsed < SAVE_REPORT_TIMEOUT_S, (
        f"the scheduler waited {elapsed:.2f} s for a worker report"
    )
    done = step.finished("p1")
    assert done is not None and set(done.ec_transfer_params or {}) == {"h-late"}
    entry = store.get("h-late")
    assert entry is not None and entry.state is EntryState.ALLOCATED
    # The report lands with no further engine step (the engine may well be idle now).
    send(step.plan, late)
    wait_until(lambda: entry.state is EntryState.READY, "the commit")
    assert stored(store, entry) == as_bytes(emb)


def test_an_idle_encoder_steps_on_until_a_late_reports_counts_are_taken(ec: EC, send: Send) -> None:
    """vLLM takes the connector's counts only in a step, and an engine with no request
    blocks for the next one: a report later than a finished request waits for would
    leave its counts unshown. The connector keeps the engine stepping
    (`has_pending_push_work`, which the real Scheduler's `has_requests` consults) until
    the report is applied and a step has taken its counts, and no longer."""
    producer = ec.scheduler("ec_producer", request_timeout_s=2.0)
    connector = producer.ec_connector
    assert connector is not None

    def idle() -> bool:  # nothing of vLLM's own left to step for
        return not producer.has_unfinished_requests() and not producer.has_finished_requests()

    # The usual order: the report is applied before the request finishes, and its counts
    # go with that step; nothing is owed.
    producer.add_request(ec.request("p0", "h-on-time", max_tokens=1))
    ec.step(producer, {"h-on-time": embedding()})
    assert ec.totals(producer).get("saved_items") == 1
    assert not connector.has_pending_push_work(), "nothing owed, yet the engine steps on"
    ec.step(producer)
    assert idle() and not producer.has_requests()

    producer.add_request(ec.request("p1", "h-late", max_tokens=1))
    step = ec.step(producer, {"h-late": embedding()}, report=False)
    late = ec.worker(producer).take_report()
    assert late is not None and late.saved
    ec.finish_step(producer, step)  # finished, its report still on its way
    assert step.finished("p1") is not None
    for _ in range(3):  # vLLM's loop steps on with no request rather than block
        assert connector.has_pending_push_work()
        ec.step(producer)
        assert idle() and producer.has_requests()
    assert ec.totals(producer).get("saved_items") == 1

    send(step.plan, late)
    steps = 0
    while producer.has_requests():
        ec.step(producer)
        steps += 1
        assert steps < 5000, "the engine was kept stepping after the report was applied"
        time.sleep(0.001)  # as vLLM sleeps between steps that run no model
    totals = ec.totals(producer)
    assert totals.get("saved_items") == 2, totals
    assert totals.get("save_us", 0) > 0, totals  # the workers' counters came with it
    assert not connector.has_pending_push_work()


def test_an_idle_encoder_steps_on_for_a_late_report_only_so_long(
    ec: EC, send: Send, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each empty step costs the engine most of a core: for a report later than
    STEP_ON_S after its save was planned, the engine goes idle, and the counts wait for
    the next request's step."""
    monkeypatch.setattr(saves, "STEP_ON_S", 0.3)
    producer = ec.scheduler("ec_producer", request_timeout_s=2.0)
    connector = producer.ec_connector
    assert connector is not None
    producer.add_request(ec.request("p1", "h-very-late", max_tokens=1))
    step = ec.step(producer, {"h-very-late": embedding()}, report=False)
    late = ec.worker(producer).take_report()
    assert late is not None and late.saved
    ec.finish_step(producer, step)
    assert connector.has_pending_push_work()
    time.sleep(0.35)
    assert not connector.has_pending_push_work()
    ec.step(producer)
    assert not producer.has_requests()

    send(step.plan, late)  # applied all the same, its counts with the next request's step
    entry = ec.side(producer).store.get("h-very-late")
    assert entry is not None
    wait_until(lambda: entry.state is EntryState.READY, "the commit")
    assert ec.totals(producer).get("saved_items") is None
    producer.add_request(ec.request("p2", "h-next", max_tokens=1))
    ec.step(producer, {"h-next": embedding()})
    assert ec.totals(producer).get("saved_items") == 2


def test_late_report_of_an_abandoned_save_never_commits_a_new_one(ec: EC, send: Send) -> None:
    timing = {
        "save_report_timeout_s": 0.5,
        "fetch_deadline_base_s": 0.3,
        "fetch_deadline_max_s": 0.4,
        "request_timeout_s": 0.2,
    }
    producer = ec.scheduler("ec_producer", **timing)
    side = ec.side(producer)
    producer.add_request(ec.request("p1", "h-again", max_tokens=1))
    step = ec.step(producer, {"h-again": embedding()}, report=False)
    late = ec.worker(producer).take_report()
    assert late is not None and late.saved
    ec.finish_step(producer, step)
    connector = producer.ec_connector
    assert connector is not None and connector.has_pending_push_work()  # idle, stepping on
    time.sleep(0.6)  # past the lease: the save is given up
    ec.step(producer)
    assert side.store.get("h-again") is None
    # A report that never came keeps an idle engine stepping no longer than that.
    assert not connector.has_pending_push_work()

    # The same item again, encoded again: a new save, whose bytes the workers have not
    # written yet.
    producer.reset_encoder_cache()
    emb = embedding()
    producer.add_request(ec.request("p2", "h-again", max_tokens=1))
    out = producer.schedule()
    assert "h-again" in out.ec_connector_metadata.plan.saves
    fresh = side.store.get("h-again")
    assert fresh is not None and fresh.state is EntryState.ALLOCATED
    send(out.ec_connector_metadata.plan, late)  # the first save's report arrives only now
    seen: dict[str, int] = {}
    wait_until(
        lambda: bool(seen.update(side.take_stats()) or seen.get("stale_reports")),
        "the late report recognised as stale",
    )
    assert fresh.state is EntryState.ALLOCATED, "a stale report committed unwritten bytes"

    ec.run_workers(producer, out, {"h-again": emb})
    assert fresh.state is EntryState.READY
    assert stored(side.store, fresh) == as_bytes(emb)


def test_item_the_engine_took_from_its_encoder_cache_is_stored_again(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    side = ec.side(producer)
    emb = embedding()
    assert set(ec.encode(producer, "p1", "h-cached", emb)) == {"h-cached"}
    side.store.remove("h-cached")  # evicted from the region meanwhile

    # The engine's own encoder cache still holds the item: it encodes nothing.
    producer.add_request(ec.request("p2", "h-cached", max_tokens=1))
    step = ec.step(producer, {}, cached={"h-cached": emb})

    assert step.out.scheduled_encoder_inputs == {}
    done = step.finished("p2")
    assert done is not None and set(done.ec_transfer_params or {}) == {"h-cached"}
    entry = side.store.get("h-cached")
    assert entry is not None and entry.state is EntryState.READY
    assert stored(side.store, entry) == as_bytes(emb)


def test_a_request_finishing_as_its_report_lands_sees_the_item_saving_or_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finishing request waits for its save's report (`await_reports`), on the
    scheduler's thread, while the report listener applies it. Woken, it must find the
    entry still being saved or READY, never between, or it answers without announcing
    the item (a request whose item prefill/decode then encodes itself). The commit is
    slowed here so that the window is wide."""
    with Region.create(4 << 20, name="ecshare-test-saves") as region:
        store = Store(region, 4096)
        book = SaveBook(store, Config(), Tally())
        op = book.plan("h", EntryMeta(dtype="uint8", shape=(5000,)), 5000)
        assert op is not None
        commit = store.commit

        def slow_commit(entry: Entry, **kwargs: Any) -> Entry:
            time.sleep(0.2)
            return commit(entry, **kwargs)

        monkeypatch.setattr(store, "commit", slow_commit)
        seen: list[tuple[bool, EntryState | None, bool]] = []

        def finish() -> None:
            reported = book.await_reports(["h"], 5.0)
            entry = store.get("h")
            seen.append((reported, entry.state if entry else None, book.saving("h") is not None))

        waiter = threading.Thread(target=finish)
        waiter.start()
        time.sleep(0.05)  # the request waits for its report
        book.apply(StepReport(saved={op.grant: ("uint8", (5000,))}))
        waiter.join(5.0)

        assert seen == [(True, EntryState.READY, False)]
