"""A producer in another process: a region with a known pattern, served over NIXL,
and a reader in another process, which a test can kill in the middle of a read.

Imported by the transport tests and run in spawned children; the parent talks
to them through a pipe.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from ecshare.transport import NixlTransport, PeerInfo, ReadState, Segment

LOOPBACK = {"UCX_NET_DEVICES": "lo"}


def pattern(seed: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def address(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)


def _serve(
    conn: Connection,
    name: str,
    size: int,
    seed: int,
    env: dict[str, str],
    stderr: str | None,
    transport_kw: dict[str, Any],
) -> None:
    if stderr is not None:  # UCX writes its fatal errors straight to descriptor 2
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    os.environ.update(env)
    mm = mmap.mmap(-1, size)
    np.frombuffer(mm, dtype=np.uint8)[:] = pattern(seed, size)
    t = NixlTransport(name, **transport_kw)
    t.register(address(mm), size)
    conn.send(t.local_info())
    notifs: list[tuple[str, bytes]] = []
    private = mmap.mmap(-1, 1 << 20)  # memory of this process that NIXL never registered
    while True:
        notifs.extend(t.progress())
        if not conn.poll(0.0005):
            continue
        cmd, arg = conn.recv()
        if cmd == "notifs":
            conn.send(notifs)
            notifs = []
        elif cmd == "slice":  # bytes [start, end) of the region, as they are now
            start, end = arg
            conn.send(bytes(mm[start:end]))
        elif cmd == "private":  # where that memory lies, and what it holds now
            conn.send((address(private), len(private), bytes(private[: arg or 0])))
        elif cmd == "sleep":  # stop progressing for a while
            time.sleep(arg)
            conn.send(None)
        elif cmd == "read_from":  # read a peer's first bytes into ours, driving it to its end
            info, length = arg
            if info.agent_name not in t.peers:
                t.add_peer(info)
            h = t.read(info.agent_name, [Segment(0, 0, length)])
            until = time.monotonic() + 10
            while t.poll(h).state is ReadState.PENDING and time.monotonic() < until:
                pass
            state = t.poll(h).state
            t.release(h)
            conn.send(state.value)
        elif cmd == "stop":
            t.close()
            conn.send(None)
            return


class Producer:
    """Handle on one producer process; with `stderr`, its descriptor 2 goes to that file."""

    def __init__(
        self,
        name: str,
        size: int,
        seed: int,
        env: Mapping[str, str] | None = None,
        stderr: Path | None = None,
        transport_kw: Mapping[str, Any] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.seed = seed
        self.stderr = stderr
        self.proc = ctx.Process(
            target=_serve,
            args=(
                child,
                name,
                size,
                seed,
                {**LOOPBACK, **(env or {})},
                None if stderr is None else str(stderr),
                dict(transport_kw or {}),
            ),
            daemon=True,
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            self.kill()
            raise TimeoutError("producer did not start")
        self.info: PeerInfo = self.conn.recv()

    def call(self, cmd: str, arg: Any = None, timeout: float = 10) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(cmd)
        return self.conn.recv()

    def notifs(self) -> list[tuple[str, bytes]]:
        return list(self.call("notifs"))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.call("stop")
        self.kill()


def _read(conn: Connection, info: PeerInfo, size: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    mm = mmap.mmap(-1, size)
    t = NixlTransport(f"reader-{os.getpid()}")
    t.register(address(mm), size)
    t.add_peer(info)
    # One read first, so that the connection is wired up before any fault.
    handle = t.read(info.agent_name, [Segment(0, 0, 4096)])
    while t.poll(handle).state is ReadState.PENDING:
        time.sleep(0.0005)
    conn.send(t.poll(handle).state.value)
    conn.recv()  # "read": post a read of the whole region, then keep it moving
    handle = t.read(info.agent_name, [Segment(0, 0, size)])
    conn.send("posted")
    while True:
        t.poll(handle)
        t.progress()
        time.sleep(0.0005)


class Reader:
    """A consumer in another process, so that a test can SIGKILL it mid-read."""

    def __init__(self, info: PeerInfo, size: int, env: Mapping[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_read, args=(child, info, size, {**LOOPBACK, **(env or {})}), daemon=True
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            self.kill()
            raise TimeoutError("reader did not start")
        warm = self.conn.recv()
        if warm != ReadState.DONE.value:
            self.kill()
            raise RuntimeError(f"reader's first read ended {warm}")

    def post_read(self) -> None:
        """Post a read of the whole region; returns once it has been handed to NIXL."""
        self.conn.send("read")
        if not self.conn.poll(30):
            raise TimeoutError("reader did not post its read")
        self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def _write(conn: Connection, info: PeerInfo, size: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    mm = mmap.mmap(-1, size)
    local = np.frombuffer(mm, dtype=np.uint8)
    t = NixlTransport(f"writer-{os.getpid()}")
    t.register(address(mm), size)
    t.add_peer(info)
    conn.send(None)
    while True:
        msg = conn.recv()
        if msg is None:
            t.close()
            return
        remote_offset, length, fill = msg
        local[:length] = fill
        handle = t.write(info.agent_name, [Segment(0, remote_offset, length)])
        deadline = time.monotonic() + 20
        while t.poll(handle).state is ReadState.PENDING and time.monotonic() < deadline:
            t.progress()
            time.sleep(0.0005)
        status = t.poll(handle)
        conn.send((status.state.value, status.failure.value if status.failure else None))
        if status.state is not ReadState.PENDING:
            t.release(handle)


class Writer:
    """Another process that loaded a peer's metadata, as every consumer of it does, and
    WRITEs into that peer's region through NIXL (what a reader never should)."""

    def __init__(self, info: PeerInfo, size: int, env: Mapping[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_write, args=(child, info, size, {**LOOPBACK, **(env or {})}), daemon=True
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            self.kill()
            raise TimeoutError("writer did not start")
        self.conn.recv()

    def write(self, remote_offset: int, length: int, fill: int) -> tuple[str, str | None]:
        """Write `length` bytes of `fill` at `remote_offset` of the peer's region; the
        write's end as the writer's transport saw it (state, failure kind)."""
        self.conn.send((remote_offset, length, fill))
        if not self.conn.poll(30):
            raise TimeoutError("writer did not finish its write")
        state, failure = self.conn.recv()
        return str(state), failure

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(10)
        self.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
