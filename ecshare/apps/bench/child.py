"""A node run as a child process, for the bench and the chaos harness.

Both tools run real `Producer` and `Consumer` nodes in processes of their own
and drive them over a `multiprocessing` pipe: typed commands in, typed events
out, every message a msgspec Struct. The harness is one trusted program, so
the pipe pickles them; this is not a wire protocol and never crosses a host.

Children fork from `multiprocessing`'s fork server, a process of its own that
imported the package (and each child's module) once and never made NIXL or ZMQ
state, which must not be forked: so a child no longer spends a second of CPU
importing what every child imports, which a fresh interpreter (the spawn
method) did, and a harness that restarts its children does it often. Each child
takes the parent's environment and working directory as they are when it
starts, not as they were when the fork server did (`_enter`). A child answers
`Ready` once it serves, or `Failed` if it cannot, and exits on `Stop`. The
parent may SIGKILL, SIGSTOP or SIGCONT it at any moment, so every wait on a
child is bounded and ends in `ChildGone`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from ecshare.transport.base import PeerInfo

__all__ = ["ChildGone", "ChildPipe", "ChildProcess", "Failed", "Ready", "Stop"]


class Ready(msgspec.Struct, frozen=True):
    """The child serves."""

    pid: int
    address: str = ""  # a producer's control endpoint
    port: int = 0
    info: PeerInfo | None = None  # a producer's data plane, for a trusted harness's raw reads


class Failed(msgspec.Struct, frozen=True):
    """The child could not start or serve; it exits after sending this."""

    error: str


class Stop(msgspec.Struct, frozen=True):
    """Stop cleanly and exit."""


class ChildGone(Exception):
    """The child died, or did not answer within its bound."""


class ChildPipe:
    """The child's end: sends from several threads, one at a time."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, event: Any) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(event)  # the parent may be gone; nothing to tell then

    def commands(self) -> Iterable[Any]:
        """Every command until `Stop`, or until the parent is gone."""
        while True:
            try:
                cmd = self._conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(cmd, Stop):
                return
            yield cmd


def _context(target: Callable[..., None]) -> mp.context.ForkServerContext:
    """The fork server's context; the first child's module is imported there once, with
    the package (a server already running keeps what it has, and a child imports the
    rest)."""
    ctx = mp.get_context("forkserver")
    assert isinstance(ctx, mp.context.ForkServerContext)
    ctx.set_forkserver_preload(["ecshare", target.__module__])
    return ctx


def _enter(environ: dict[str, str], cwd: str, target: Callable[..., None], *args: Any) -> None:
    """In the child, first: the parent's environment and directory of now (UCX and NIXL
    read theirs from the environment), then the child's own work."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    target(*args)


class ChildProcess:
    """The parent's handle on one child: commands in, replies out.

    A reader thread takes everything the child says; `_unasked` picks out the
    events the child sends of its own accord, and the rest are replies, taken in
    order by `call`.
    """

    def __init__(
        self,
        label: str,
        target: Callable[..., None],
        args: tuple[Any, ...],
        *,
        process_name: str,
        start_timeout_s: float,
    ) -> None:
        self.label = label
        self.paused = False
        self.killed = False
        self.stopping = False  # told to stop
        self._replies: queue.Queue[Any] = queue.Queue()
        ctx = _context(target)
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_enter,
            args=(dict(os.environ), os.getcwd(), target, child_conn, *args),
            name=process_name,
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self._reader = threading.Thread(target=self._read, name=f"{process_name}-reader")
        self._reader.daemon = True
        self._reader.start()
        ready = self._reply(start_timeout_s, "start")
        if not isinstance(ready, Ready):
            self.kill()
            raise ChildGone(f"{self.name} did not start: {ready}")
        self.ready = ready

    @property
    def name(self) -> str:
        return f"{self.label} (pid {self.process.pid})"

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _unasked(self, event: Any) -> bool:
        """Hand on `event` if the child sent it unasked, and say so; replies are kept."""
        return False

    def _read(self) -> None:
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                self._replies.put(None)
                return
            if not self._unasked(event):
                self._replies.put(event)

    def _reply(self, timeout_s: float, what: str) -> Any:
        try:
            event = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ChildGone(f"{self.name}: no answer to {what} within {timeout_s} s") from None
        if event is None:
            raise ChildGone(f"{self.name} exited (code {self.process.exitcode})")
        return event

    def drained(self, within_s: float) -> None:
        """Wait (up to `within_s`) until everything the child said has been handed on:
        once it has exited, its reader ends at the pipe's end."""
        self._reader.join(timeout=within_s)

    def alive(self) -> bool:
        return not self.killed and self.process.is_alive()

    def exited(self, within_s: float) -> bool:
        """Whether the process has exited, waiting up to `within_s` for it: a crashing
        child closes its pipe a moment before it can be reaped."""
        self.process.join(timeout=within_s)
        return self.process.exitcode is not None

    def crashed(self) -> bool:
        """It exited by itself: neither killed nor told to stop."""
        return not self.killed and not self.stopping and self.process.exitcode is not None

    def send(self, cmd: Any) -> None:
        try:
            self._conn.send(cmd)
        except (OSError, ValueError) as exc:
            raise ChildGone(f"{self.name}: cannot send {type(cmd).__name__}: {exc}") from exc

    def call(self, cmd: Any, timeout_s: float) -> Any:
        self.send(cmd)
        return self._reply(timeout_s, type(cmd).__name__)

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would; reaped within a bound."""
        self.killed = True
        self.signal(signal.SIGKILL)
        self.process.join(timeout=10)
        self._conn.close()

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout_s: float) -> bool:
        """Ask the child to stop; False (and SIGKILL) if it does not exit within `timeout_s`."""
        self.stopping = True
        if self.paused:
            self.resume()
        if not self.process.is_alive():
            self.process.join(timeout=1)
            return True
        with contextlib.suppress(ChildGone):
            self.send(Stop())
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.kill()
            return False
        self._conn.close()
        return True
