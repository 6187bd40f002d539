"""A producer must outlive a consumer that died while the producer was stopped.

Over UCX_TLS=tcp this does not hold with UCX 1.23.0 (the build nixl-cu12 1.5.1
bundles), and no UCX or NIXL setting changes it; these tests pin the failure
down, strictly, so that they start failing (XPASS) the day a UCX fix lands.

Why. UCT's TCP transport cannot do RMA GET (``uct_tcp_iface_query`` in
``src/uct/tcp/tcp_iface.c`` offers AM and PUT_ZCOPY, no GET), so UCP emulates
every NIXL READ in software: the reader sends a GET request, and the target
answers it from an active-message handler, ``ucp_get_req_handler``
(``src/ucp/rma/rma_sw.c``), with ``ucp_request_send(req)``. That loops on
``ucp_request_try_send`` (``src/ucp/core/ucp_request.inl``), which takes
``UCS_OK``, ``UCS_INPROGRESS`` and ``UCS_ERR_NO_RESOURCE`` and answers any other
status with ``ucs_fatal("unexpected error: %s")``: line 356 there, then abort().

A stopped target does not read its sockets, so the reader's GET requests wait
in its receive buffer. Once the reader dies, its kernel closes the connection
(FIN, then RST on the target's next send). After SIGCONT the target's first
progress reads the queued requests and answers them; the reply's ``send()``
fails with EPIPE, ``uct_tcp_ep_send`` reports the failure to the error handler
(which, in UCP_ERR_HANDLING_MODE_PEER, NIXL's default, fails and destroys the
endpoint correctly) and returns ``UCS_ERR_ENDPOINT_TIMEOUT``
(``src/uct/tcp/tcp_ep.c``), and ``ucp_request_try_send`` aborts the process:
``ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout``. The stack is
``nixlUcxEngine::progress`` -> ``ucp_worker_progress`` ->
``uct_tcp_iface_progress`` -> ``ucp_get_req_handler``.

Measured with this test's scenario and variants of it: the target aborts every
time, stopped for 0.1 s or 3 s, with NIXL's UCX backend parameters
``ucx_error_handling_mode`` peer (the default) or none, or
``ucx_ep_close_force``, with UCX_KEEPALIVE_INTERVAL=10ms (UCP's keepalive runs
after the interface's receive progress, which is where the requests are
answered), or with UCX_TCP_KEEPIDLE/KEEPINTVL; stopped in the middle of a read
(rather than before it) it aborts as well whenever the read was still in
flight. UCX_PROTO_ENABLE=n fails every READ instead (this UCX has no protocol
v1 RMA left).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from nixl_peer_proc import Producer, Reader, pattern
from test_nixl_transport import SIZE, Side

from ecshare.apps.chaos.crashes import ConsumerEnd, Stop, ucx_abort_evidence
from ecshare.transport import ReadState, Segment

TCP = {"UCX_TLS": "tcp"}
pytestmark = pytest.mark.timeout(120)


class KnownUcxAbort(Exception):
    """The target died of the known abort, with every sign the chaos harness asks of it."""


# Only that abort is expected: any other death of the target fails the test.
UCX_SW_GET_ABORT = pytest.mark.xfail(
    strict=True,
    raises=KnownUcxAbort,
    reason="UCX 1.23.0: ucp_get_req_handler aborts when its reply to a dead reader fails "
    "(ucp_request.inl:356); no UCX or NIXL setting avoids it, see the module docstring",
)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Producer]:
    p = Producer(
        f"target-{uuid.uuid4().hex[:8]}", SIZE, seed=21, env=TCP, stderr=tmp_path / "target.err"
    )
    try:
        yield p
    finally:
        if p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGCONT)
        p.stop()


@dataclass
class Timeline:
    """The stop of the target and the reader's death, on one clock (seconds from t0)."""

    t0: float = field(default_factory=time.monotonic)
    stopped_s: float = 0.0
    reader_killed_s: float = 0.0
    resumed_s: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0


def _assert_alive(p: Producer, what: str, timeline: Timeline) -> None:
    p.proc.join(1.0)  # a dying process's end is seen once it has been reaped
    if p.proc.exitcode is None:
        return
    assert p.stderr is not None
    stderr = p.stderr.read_text(errors="replace")
    evidence = ucx_abort_evidence(
        exitcode=p.proc.exitcode,
        stderr=stderr,
        transport="tcp",
        stops=[Stop("pause_producer", timeline.stopped_s, timeline.resumed_s)],
        ends=[ConsumerEnd("kill_consumer", "reader", timeline.reader_killed_s)],
        died_at_s=timeline.now(),
    )
    if evidence is not None:
        raise KnownUcxAbort(evidence)
    raise AssertionError(
        f"the target died {what} (exit code {p.proc.exitcode}), not of the known UCX abort; "
        f"its stderr ended: {stderr[-2000:]!r}"
    )


@UCX_SW_GET_ABORT
def test_target_survives_a_reader_killed_while_it_was_stopped(target: Producer) -> None:
    timeline = Timeline()
    reader = Reader(target.info, SIZE, env=TCP)
    try:
        os.kill(target.proc.pid, signal.SIGSTOP)
        timeline.stopped_s = timeline.now()
        reader.post_read()  # its GET requests wait, unread, in the stopped target's socket
        time.sleep(0.2)
    finally:
        reader.kill()
        timeline.reader_killed_s = timeline.now()
    time.sleep(1.0)  # the target stays stopped a while after the reader's death
    os.kill(target.proc.pid, signal.SIGCONT)
    timeline.resumed_s = timeline.now()

    # A round trip through the target's loop: it has progressed UCX since SIGCONT.
    # If it died instead, the assertion below says how.
    with contextlib.suppress(EOFError, OSError, TimeoutError):
        target.notifs()
    time.sleep(0.5)
    _assert_alive(target, "after SIGCONT, serving a reader that had died", timeline)

    # And it still serves a new reader.
    side = Side(ucx_env=TCP)
    try:
        side.t.add_peer(target.info)
        status = side.read(target.info.agent_name, [Segment(0, 0, SIZE)])
        assert status.state is ReadState.DONE, status
        assert np.array_equal(side.mem, pattern(21, SIZE))
    finally:
        side.close()
    _assert_alive(target, "serving a new reader", timeline)
