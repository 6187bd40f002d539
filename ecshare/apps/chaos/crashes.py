"""Why a producer died by itself: what it wrote to stderr, and the one death forgiven.

A child that exits by itself is a crash, and a crash breaks the run, with one
exception: UCX 1.23's abort in a producer over UCX TCP that resumes from a stop
around which a consumer it served went away (docs/RELIABILITY.md, "Crashes
seen"; `tests/transport/test_transport_peer_death.py` reproduces it). The
stopped producer finds the gone reader's requests in its socket on SIGCONT,
its reply fails, and `ucp_request_try_send` calls `ucs_fatal`, which writes

    [host:pid:thread:tid] ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout

straight to file descriptor 2 (not to `UCX_LOG_FILE`) and aborts. ecshare
cannot fix that; in production the producer's supervisor restarts it and
consumers fail over meanwhile. The harness plays that supervisor, for this
death only: `ucx_abort_evidence` takes it for the known abort only if every
sign of it is there (SIGABRT, that line, UCX TCP, a stop of this producer by a
fault, the death within `AFTER_RESUME_S` of its resume, and a consumer that
ended while the producer was stopped or in the `BEFORE_STOP_S` before), and
says why. Anything else stays a crash.

A consumer "ends" when the harness SIGKILLs it or stops it to replace it
(`shrink_push_deadline`): either way its sockets close while the producer
cannot answer. Both were seen to lead to this abort, as was a consumer killed
0.75 s and one killed about 2 s before the producer's stop began (with pushes to
it in flight); the abort came 0.3 to 0.4 s after the resume each time.

`StderrTap` is how the harness sees that line: a producer's file descriptor 2 is
a FIFO the harness reads. What comes through is passed on to the harness's own
stderr as it comes, as the child's stderr was before, and the last of it kept.
The reader is the harness, so nothing the producer wrote before it died is lost
with it, and the reader's end of file says the producer has written all it will.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The fatal line of the known abort, as `ucs_log_fatal_error` writes it (UCX 1.23.0,
# the build NIXL 1.5 bundles): a "[host:pid:thread:tid]" prefix, then this.
UCX_ABORT_LINE = re.compile(
    r"^\[[^\]\n]*\]\s+ucp_request\.inl:356\s+Fatal: unexpected error: Endpoint timeout\s*$",
    re.MULTILINE,
)
# The faults that leave a producer stopped, and then resume it.
PRODUCER_STOP_KINDS = frozenset(
    {"pause_producer", "freeze_producer_mid_read", "readd_peer", "freeze_producer_mid_push"}
)
# The faults that end a consumer: SIGKILLed, or stopped to be replaced.
CONSUMER_END_KINDS = frozenset({"kill_consumer", "kill_consumer_mid_push", "shrink_push_deadline"})
# How long before a producer's stop a consumer's end still counts, and how soon after
# the resume the producer must die (seen: 0.75 and about 2 s; 0.3 to 0.4 s).
BEFORE_STOP_S = 5.0
AFTER_RESUME_S = 5.0
# How much of a producer's stderr is kept: the end of it says why it died.
_KEEP_BYTES = 64 * 1024


@dataclass(frozen=True)
class Stop:
    """A producer stopped by the fault `kind`, from `start_s` to SIGCONT at `end_s`
    (seconds into the load, the fault log's clock)."""

    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ConsumerEnd:
    """The consumer `name` ended by the fault `kind` at `at_s`: SIGKILLed, or stopped
    to be replaced."""

    kind: str
    name: str
    at_s: float


def ucx_abort_evidence(
    *,
    exitcode: int | None,
    stderr: str,
    transport: str,
    stops: Sequence[Stop],
    ends: Sequence[ConsumerEnd],
    died_at_s: float,
) -> str | None:
    """Why a producer's death is the known UCX abort, or None if it is not.

    `exitcode` is the process's (`-signal` if a signal ended it), `stderr` what it
    wrote there, `transport` the run's (`ChaosOptions.ucx_tls`), `stops` the stops
    of this producer process that ended in SIGCONT, `ends` the consumers the run
    ended, `died_at_s` when its death was seen (the fault log's clock).
    """
    if exitcode != -signal.SIGABRT or transport != "tcp":
        return None
    line = UCX_ABORT_LINE.search(stderr)
    if line is None:
        return None
    for stop in stops:
        if stop.kind not in PRODUCER_STOP_KINDS:
            continue
        if not stop.end_s <= died_at_s <= stop.end_s + AFTER_RESUME_S:
            continue
        for end in ends:
            if (
                end.kind in CONSUMER_END_KINDS
                and stop.start_s - BEFORE_STOP_S <= end.at_s <= stop.end_s
            ):
                return (
                    f"SIGABRT after {line.group().strip()!r} at {died_at_s:.3f} s: stopped by "
                    f"{stop.kind} {stop.start_s:.3f}-{stop.end_s:.3f} s, {end.name} ended by "
                    f"{end.kind} at {end.at_s:.3f} s"
                )
    return None


class StderrTap:
    """A child's stderr through a FIFO at `path` (the child opens it, `child_stderr`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        # A reader first: the child's open for writing then returns at once.
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._kept = b""
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Read until the child's end closes; call once the child has opened it (`Ready`):
        before that a read finds no writer and ends at once."""
        os.set_blocking(self._fd, True)
        self._reader = threading.Thread(target=self._read, name=f"stderr-{self.path.name}")
        self._reader.daemon = True
        self._reader.start()

    def _read(self) -> None:
        try:
            while chunk := os.read(self._fd, 65536):
                with contextlib.suppress(OSError):
                    os.write(2, chunk)
                self._kept = (self._kept + chunk)[-_KEEP_BYTES:]
        finally:
            os.close(self._fd)

    def close(self) -> None:
        """For a child that never started: nobody reads then."""
        if self._reader is None:
            os.close(self._fd)

    def text(self, within_s: float) -> str:
        """The last of what the child wrote, once it has exited: waits up to `within_s` for
        the end of its stderr (a process it started may still hold it)."""
        if self._reader is not None:
            self._reader.join(timeout=within_s)
        return self._kept.decode(errors="replace")


def child_stderr(path: str) -> None:
    """In the child, first: file descriptor 2 (UCX's fatal errors, Python's stderr)
    becomes the FIFO the harness reads."""
    fd = os.open(path, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)
