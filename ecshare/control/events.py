"""Socket monitor events, read on a thread of their own.

libzmq's I/O thread writes monitor events into a PAIR socket and BLOCKS when
that socket's queue is full (measured: about 2,000 unread events freeze every
socket of the context). Anyone who can reach a server's port can cause events
(each failed handshake is one), and a client whose owner stops polling it
still gets some at every reconnect. So events are never left to the serving
loop: one thread per zmq context reads every watched monitor as soon as
events arrive, over a PAIR with no queue limit, and hands each event to a
callback (which must be quick and thread-safe).

The thread exists while something is watched, and closes each monitor's PAIR
once libzmq reports the monitor stopped, so that a context can terminate.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any, Self

import zmq

from ecshare.control.link import SocketEvent, read_events
from ecshare.control.waker import Waker

log = logging.getLogger(__name__)

EventCallback = Callable[[SocketEvent], None]


class Watch:
    """Events of one socket flowing to a callback; `stop()` from the socket's own thread."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._socket: zmq.Socket[bytes] | None = sock

    def stop(self) -> None:
        """Idempotent. The pump closes its side when libzmq confirms the stop."""
        sock, self._socket = self._socket, None
        if sock is not None and not sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()


class Watched:
    """What a control client and server share: a socket whose events a `Watch` reads,
    closed once (`close`, or the end of a `with` block) from the owner's thread."""

    _socket: zmq.Socket[bytes]
    _watch: Watch | None
    _closed: bool

    def close(self) -> None:
        """Idempotent. Queued messages get the socket's `linger_ms` to leave."""
        if self._closed:
            return
        self._closed = True
        self._release(self._socket)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _release(self, sock: zmq.Socket[bytes]) -> None:
        if self._watch is not None:
            self._watch.stop()
        sock.close()


def watch(sock: zmq.Socket[bytes], events: int, on_event: EventCallback) -> Watch:
    """Call `on_event` (on the pump thread) for each of `events` on `sock`.

    Call from the thread that owns `sock`, before it connects or binds, so that no
    handshake goes unseen.
    """
    context: zmq.Context[Any] = sock.context
    address = f"inproc://ecshare-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events | zmq.EVENT_MONITOR_STOPPED)
    reader: zmq.Socket[bytes] = context.socket(zmq.PAIR)
    reader.setsockopt(zmq.LINGER, 0)
    # No limit on this side makes the inproc pipe unbounded, so the I/O thread
    # never blocks on us; the pump keeps it short.
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(address)
    with _registry_lock:
        pump = _pumps.get(id(context))
        if pump is None or not pump.add(reader, on_event):
            pump = _Pump(context)
            _pumps[id(context)] = pump
            pump.add(reader, on_event)
            pump.start()
    return Watch(sock)


_registry_lock = threading.Lock()
_pumps: dict[int, _Pump] = {}


class _Pump(threading.Thread):
    def __init__(self, context: zmq.Context[Any]) -> None:
        super().__init__(name="ecshare-monitor", daemon=True)
        self.context = context
        self._incoming: queue.SimpleQueue[tuple[zmq.Socket[bytes], EventCallback]] = (
            queue.SimpleQueue()
        )
        self._watched: dict[zmq.Socket[bytes], EventCallback] = {}
        self._waker = Waker()
        self._accepting = True  # guarded by _registry_lock

    def add(self, reader: zmq.Socket[bytes], on_event: EventCallback) -> bool:
        """Hand a monitor over (under _registry_lock); False once this pump is ending."""
        if not self._accepting:
            return False
        self._incoming.put((reader, on_event))
        self._waker.wake()
        return True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker, zmq.POLLIN)
        try:
            while True:
                self._waker.clear()
                self._take_incoming(poller)
                if not self._watched and self._retire():
                    return
                for reader, _ in poller.poll():
                    if reader in self._watched:
                        self._pump(reader, poller)
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("socket monitor thread failed; handshake state is no longer updated")
        finally:
            for reader in self._watched:
                reader.close(0)
            self._waker.close()

    def _take_incoming(self, poller: zmq.Poller) -> None:
        while True:
            try:
                reader, on_event = self._incoming.get_nowait()
            except queue.Empty:
                return
            self._watched[reader] = on_event
            poller.register(reader, zmq.POLLIN)

    def _retire(self) -> bool:
        with _registry_lock:
            if not self._incoming.empty():
                return False
            self._accepting = False
            if _pumps.get(id(self.context)) is self:
                del _pumps[id(self.context)]
            return True

    def _pump(self, reader: zmq.Socket[bytes], poller: zmq.Poller) -> None:
        on_event = self._watched[reader]
        for event in read_events(reader):
            if event.kind == zmq.EVENT_MONITOR_STOPPED:
                poller.unregister(reader)
                del self._watched[reader]
                reader.close(0)
                return
            try:
                on_event(event)
            except Exception:
                log.exception("socket event callback failed on %s", event.name)
