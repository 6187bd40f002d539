"""Waking a network thread that sleeps in `zmq.Poller.poll` from any other thread.

ZMQ sockets must not be shared between threads, so engine threads cannot send
on the network thread's sockets. Instead they put work on a queue and call
`wake()`; the network thread polls `waker` (by file descriptor) with its
sockets, and when it fires calls `clear()` and then drains the queue. That
order (producers: enqueue, then wake; network thread: clear, then drain)
never loses a wake-up.

An eventfd where the OS has one (a single descriptor, a counter that cannot
fill up), a non-blocking pipe elsewhere.
"""

from __future__ import annotations

import os
import threading

# An eventfd write must be exactly 8 bytes (a counter increment); a pipe takes them too.
_ONE = (1).to_bytes(8, "little")


class Waker:
    """A file descriptor that becomes readable when any thread calls `wake()`."""

    def __init__(self) -> None:
        self._closed = False
        # Held around writes and close: a write racing close() could otherwise land on
        # an unrelated file that reused the descriptor number.
        self._lock = threading.Lock()
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._read_fd, self._write_fd = fd, fd
        else:  # pragma: no cover - not Linux
            self._read_fd, self._write_fd = os.pipe()
            for fd in (self._read_fd, self._write_fd):
                os.set_blocking(fd, False)

    def fileno(self) -> int:
        """For `zmq.Poller.register(waker, zmq.POLLIN)` or `select`."""
        return self._read_fd

    def wake(self) -> None:
        """Make `fileno()` readable. Thread-safe, never blocks, cheap to repeat."""
        with self._lock:
            if self._closed:
                return
            # Not contextlib.suppress: a context manager is three more Python calls, on
            # a path that runs cold after an idle gap. A full pipe is readable already.
            try:  # noqa: SIM105
                os.write(self._write_fd, _ONE)
            except BlockingIOError:
                pass

    def clear(self) -> None:
        """Consume every pending wake-up; call it before looking at the work queue."""
        if self._closed:
            return
        while True:
            try:
                if not os.read(self._read_fd, 4096):
                    return
            except BlockingIOError:
                return
            if self._read_fd == self._write_fd:
                return  # an eventfd is drained by one read

    def close(self) -> None:
        """Idempotent; `wake()` after close is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            if self._write_fd != self._read_fd:
                os.close(self._write_fd)

    def __enter__(self) -> Waker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
