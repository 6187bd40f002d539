"""The one death of a producer the chaos harness forgives: UCX 1.23's abort over TCP
soon after the producer resumed from a stop around which a consumer went away
(SIGKILLed or stopped, while it was stopped or shortly before; docs/RELIABILITY.md,
"Crashes seen"). It is told from every other death by all of its signs at once,
counted in the report and restarted; anything else stays a crash.
"""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import pytest

from ecshare.apps.chaos.crashes import (
    AFTER_RESUME_S,
    BEFORE_STOP_S,
    ConsumerEnd,
    Stop,
    ucx_abort_evidence,
)
from ecshare.apps.chaos.options import ChaosOptions

ABORT = -signal.SIGABRT
# A dying producer's stderr: the UCX line as tests/transport/test_transport_peer_death.py's
# target prints it, between a log line of the producer's and UCX's backtrace.
UCX_STDERR = (
    "2025-01-07 10:12:31,404 48211 ERROR ecshare.peer.producer: session of consumer 2 ended\n"
    "[ci-runner:48211:0:48230] ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout\n"
    "==== backtrace (tid:  48230) ====\n"
    " 0  /nixl/.libs/libucs.so.0(ucs_handle_error+0x2e4) [0x7f3a1c2b6f34]\n"
)
# A producer frozen mid-push from 10.0 s to 13.5 s; consumer 2 killed mid-push meanwhile;
# the producer dead 0.3 s after it resumed.
FROZEN = Stop("freeze_producer_mid_push", 10.0, 13.5)
KILLED = ConsumerEnd("kill_consumer_mid_push", "consumer 2 (pid 48199)", 11.2)
DIED = 13.8


def _evidence(
    *,
    exitcode: int | None = ABORT,
    stderr: str = UCX_STDERR,
    transport: str = "tcp",
    stops: tuple[Stop, ...] = (FROZEN,),
    ends: tuple[ConsumerEnd, ...] = (KILLED,),
    died_at_s: float = DIED,
) -> str | None:
    return ucx_abort_evidence(
        exitcode=exitcode,
        stderr=stderr,
        transport=transport,
        stops=stops,
        ends=ends,
        died_at_s=died_at_s,
    )


def test_the_known_abort_is_sigabrt_the_ucx_line_tcp_and_a_consumer_killed_during_a_stop() -> None:
    evidence = _evidence()
    assert evidence is not None
    assert "ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout" in evidence
    assert "at 13.800 s" in evidence
    assert "freeze_producer_mid_push 10.000-13.500 s" in evidence
    assert "consumer 2 (pid 48199) ended by kill_consumer_mid_push at 11.200 s" in evidence
    # Every stop kind and consumer end kind of the harness counts, among others.
    for stop_kind in ("pause_producer", "freeze_producer_mid_read", "readd_peer"):
        for kill_kind in ("kill_consumer", "kill_consumer_mid_push", "shrink_push_deadline"):
            stops = (Stop("pause_producer", 1.0, 2.0), Stop(stop_kind, 5.0, 8.0))
            ends = (
                ConsumerEnd(kill_kind, "consumer 1", 0.5),
                ConsumerEnd(kill_kind, "consumer 3", 8.0),
            )
            assert _evidence(stops=stops, ends=ends, died_at_s=8.4) is not None, (
                stop_kind,
                kill_kind,
            )


def test_a_consumer_gone_shortly_before_the_stop_or_stopped_during_it_counts_too() -> None:
    """As seen in chaos runs over TCP: a consumer SIGKILLed 0.75 s (and about 2 s)
    before the producer's stop began, with pushes to it in flight; a consumer
    stopped and replaced while the producer was stopped."""
    shortly_before = ConsumerEnd("kill_consumer_mid_push", "consumer 1", 10.0 - 0.75)
    assert _evidence(ends=(shortly_before,)) is not None
    assert _evidence(ends=(ConsumerEnd("kill_consumer", "consumer 1", 8.0),)) is not None
    replaced = ConsumerEnd("shrink_push_deadline", "consumer 2", 12.8)
    evidence = _evidence(ends=(replaced,))
    assert evidence is not None and "ended by shrink_push_deadline at 12.800 s" in evidence
    # The bound: up to BEFORE_STOP_S before the stop.
    assert _evidence(ends=(ConsumerEnd("kill_consumer", "consumer 1", 10.0 - BEFORE_STOP_S),))
    assert not _evidence(ends=(ConsumerEnd("kill_consumer", "consumer 1", 9.99 - BEFORE_STOP_S),))


def test_a_death_long_after_the_resume_is_a_crash() -> None:
    assert _evidence(died_at_s=13.5 + AFTER_RESUME_S) is not None
    assert _evidence(died_at_s=13.51 + AFTER_RESUME_S) is None
    assert _evidence(died_at_s=13.4) is None  # still stopped: it cannot have run


def test_a_death_by_another_signal_or_exit_code_is_a_crash() -> None:
    assert _evidence(exitcode=-signal.SIGSEGV) is None
    assert _evidence(exitcode=-signal.SIGKILL) is None
    assert _evidence(exitcode=1) is None
    assert _evidence(exitcode=None) is None


def test_sigabrt_without_the_exact_ucx_line_is_a_crash() -> None:
    libzmq = "Assertion failed: !_io_error (src/stream_engine_base.cpp:310)\n"
    assert _evidence(stderr=libzmq) is None
    assert _evidence(stderr="") is None
    for near_miss in (
        # Another fatal error at the same place, the same one elsewhere in UCX, the
        # message alone, and the line quoted inside a Python log line.
        "[h:1:0:1] ucp_request.inl:356  Fatal: unexpected error: Connection reset by remote peer",
        "[h:1:0:1] ucp_request.inl:357  Fatal: unexpected error: Endpoint timeout",
        "[h:1:0:1]       rma_sw.c:120  Fatal: unexpected error: Endpoint timeout",
        "Fatal: unexpected error: Endpoint timeout",
        "ERROR x: saw '[h:1:0:1] ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout'",
    ):
        assert _evidence(stderr=near_miss + "\n") is None, near_miss


def test_the_ucx_line_over_cross_memory_attach_is_a_crash() -> None:
    # Over cma a READ is the reader's own copy: no get request waits at the producer.
    assert _evidence(transport="cma") is None


def test_no_consumer_gone_around_the_stop_is_a_crash() -> None:
    assert _evidence(ends=()) is None
    assert _evidence(stops=()) is None
    long_before = ConsumerEnd("kill_consumer", "consumer 2", 4.9)  # 5.1 s before the stop
    after = ConsumerEnd("kill_consumer_mid_push", "consumer 2", 13.6)  # after the resume
    assert _evidence(ends=(long_before, after)) is None
    # A fault that ends no consumer, and a consumer's stop rather than a producer's.
    assert _evidence(ends=(ConsumerEnd("fill_consumer_region", "consumer 2", 11.2),)) is None
    assert _evidence(stops=(Stop("freeze_consumer_mid_push", 10.0, 13.5),)) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("killed_while_stopped", [True, False], ids=["known", "crash"])
def test_a_producer_dead_of_the_ucx_abort_is_restarted_and_counted_and_any_other_is_a_crash(
    tmp_path: Path, killed_while_stopped: bool
) -> None:
    pytest.importorskip("nixl._api")
    from ecshare.apps.chaos.harness import ChaosRun
    from ecshare.apps.chaos.report import print_report

    run = ChaosRun(ChaosOptions(producers=1, consumers=1, ucx_tls="tcp"), tmp_path)
    run.load_started = time.monotonic()
    try:
        producer = run.start_producer(0)
        port = run.ports[0]
        consumer = run.start_consumer()
        producer.pause()
        run._stopped(producer, "pause_producer")
        if killed_while_stopped:
            consumer.kill()
            run._consumer_ended(consumer, "kill_consumer")
        run._resume(producer)
        if not killed_while_stopped:
            consumer.kill()
            run._consumer_ended(consumer, "kill_consumer")
        # The abort, as UCX does it: its line on file descriptor 2, then SIGABRT.
        with open(f"/proc/{producer.pid}/fd/2", "w") as stderr:
            stderr.write(
                f"[vm:{producer.pid}:0:{producer.pid}] ucp_request.inl:356  "
                "Fatal: unexpected error: Endpoint timeout\n"
            )
        os.kill(producer.pid, signal.SIGABRT)
        assert producer.exited(10.0) and producer.process.exitcode == ABORT

        run._repair()  # reaped, and restarted under the same key and port

        restarted = run.producers[0]
        assert restarted is not None and restarted.pid != producer.pid
        assert restarted.ready.port == port == run.ports[0]
        report = run._report(time.monotonic(), [], 0, 0, 0)
        assert report.faults["restarts_same_key_and_port"] == 1, report.faults
        out = io.StringIO()
        print_report(report, out)
        if killed_while_stopped:
            assert report.ok and report.crashes == 0 and not report.violations, report
            assert len(report.known_ucx_aborts) == 1, report.known_ucx_aborts
            assert f"producer 0 (pid {producer.pid})" in report.known_ucx_aborts[0]
            assert "pause_producer" in report.known_ucx_aborts[0]
            assert "known UCX aborts      1" in out.getvalue(), out.getvalue()
            assert report.known_ucx_aborts[0] in out.getvalue()
        else:
            assert not report.ok and report.crashes == 1 and not report.known_ucx_aborts
            assert "ucp_request.inl:356" in report.violations[0], report.violations
            assert "known UCX aborts      0" in out.getvalue(), out.getvalue()
    finally:
        run._teardown()
