"""Item events: what a store holds, published to subscribers (a proxy's item directory).

The wire, typed once (msgpack): `ItemEvent` (an entry of `mm_hash` became READY,
"stored", or left the index, "evicted"), `ItemSnapshot` (everything held as of a
sequence number) and `ItemHeartbeat` (the last sequence number, when nothing else was
sent for a while). Every message carries the publisher's `incarnation`, a number taken
from the wall clock when the feed starts (a restarted instance's is larger), and a
sequence number that counts every event, sent or not.

Guarantees:

* Exact and in order: the feed mirrors the store's index through its commit and removal
  watchers. A commit is published only if its entry is still READY when the feed hears of
  it, under the feed's lock that the removal watcher (called under the table's lock) also
  takes, so an entry's "evicted" is never published before its "stored".
* Never blocks the engine: watchers only update the mirror and append to a bounded
  queue; a full queue drops the message (counted) but not its sequence number, so the
  loss is visible to every subscriber as a gap. The socket sends without blocking; a slow
  subscriber loses messages at its high-water mark, again as a gap.
* Recoverable: a snapshot goes out whenever a subscription arrives (a subscriber that
  saw a gap unsubscribes and subscribes again to ask for one; a reconnect subscribes
  again) and every `snapshot_s` seconds.
* Authenticated: under CURVE, only subscribers whose key is on the allow-list (the
  instance's admin keys) complete the handshake; others receive nothing.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Annotated, Any, Final, Literal

import msgspec
import zmq
from msgspec import Meta

from ecshare.config import Config
from ecshare.control import KeyPair, Waker, load_authorized_keys, load_keypair
from ecshare.control.auth import AllowList, ZapRegistration, register_allow_list
from ecshare.control.errors import ControlConfigError
from ecshare.store import Entry, EntryState, Store

log = logging.getLogger(__name__)

STORED: Final = "stored"
EVICTED: Final = "evicted"
MAX_HASH_CHARS: Final = 512
MAX_SNAPSHOT_ITEMS: Final = 1 << 22
MAX_FEED_MESSAGE_BYTES: Final = 256 << 20

Hash = Annotated[str, Meta(min_length=1, max_length=MAX_HASH_CHARS)]
Count = Annotated[int, Meta(ge=0)]


class ItemEvent(msgspec.Struct, tag="event", frozen=True, array_like=True):
    incarnation: Count
    seq: Count
    kind: Literal["stored", "evicted"]
    mm_hash: Hash
    nbytes: Count


class ItemSnapshot(msgspec.Struct, tag="snapshot", frozen=True, array_like=True):
    """Every entry held once events up to `seq` happened: (mm_hash, nbytes) pairs."""

    incarnation: Count
    seq: Count
    items: Annotated[tuple[tuple[Hash, Count], ...], Meta(max_length=MAX_SNAPSHOT_ITEMS)]


class ItemHeartbeat(msgspec.Struct, tag="heartbeat", frozen=True, array_like=True):
    incarnation: Count
    seq: Count


FeedMessage = ItemEvent | ItemSnapshot | ItemHeartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FeedMessage)


def encode(message: FeedMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> FeedMessage:
    """One feed message; `msgspec.ValidationError`/`DecodeError` for anything else."""
    return _decoder.decode(data)


class ItemFeed:
    """A store's item events on an XPUB socket, sent from a thread of its own."""

    def __init__(
        self,
        store: Store,
        *,
        host: str,
        port: int,
        keys: KeyPair | None,
        subscribers: frozenset[bytes],
        queue_max: int = 65536,
        send_hwm: int = 100_000,
        heartbeat_s: float = 1.0,
        snapshot_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if keys is not None and not subscribers:
            raise ControlConfigError(
                "events_port: no key may subscribe to item events; list the proxy's key "
                "in admin_keys or admin_keys_file"
            )
        self.incarnation = time.time_ns()
        self._store = store
        self._queue_max = queue_max
        self._heartbeat_s = heartbeat_s
        self._snapshot_s = snapshot_s
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._seq = 0
        self._queue: collections.deque[ItemEvent] = collections.deque()
        self._stats = dict.fromkeys(
            ("events", "dropped", "sent", "snapshots", "heartbeats", "subscriptions"), 0
        )
        self._waker = Waker()
        self._stopping = False
        self._zap: ZapRegistration | None = None
        self._allow_list = AllowList(subscribers, server="ecshare item feed")
        context = context if context is not None else zmq.Context.instance()
        sock: zmq.Socket[bytes] = context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, send_hwm)
            # Every subscription reaches us, so that each one gets a snapshot.
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            if keys is not None:
                self._zap = register_allow_list(context, self._allow_list)
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                sock.setsockopt_string(zmq.ZAP_DOMAIN, self._zap.domain)
                # Fail closed should the ZAP handler be gone (where libzmq knows how).
                with contextlib.suppress(zmq.ZMQError, AttributeError):
                    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                raise ControlConfigError(f"events_port: cannot bind to {address}: {exc}") from None
        except BaseException:
            sock.close(0)
            if self._zap is not None:
                self._zap.close()
            self._waker.close()
            raise
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self._socket = sock
        self._unwatch = (store.watch_commits(self._committed), store.watch_removals(self._left))
        self._thread = threading.Thread(target=self._run, name="ecshare-item-feed", daemon=True)
        self._thread.start()
        log.info("ecshare: item events on %s (incarnation %d)", self.endpoint, self.incarnation)

    # -- engine side (any thread, never blocks) ----------------------------------------------

    def _committed(self, entry: Entry) -> None:
        with self._lock:
            # Already gone means its removal was heard (or is being heard) first.
            if entry.state is not EntryState.READY:
                return
            self._held[entry.mm_hash] = entry.nbytes
            self._publish(STORED, entry.mm_hash, entry.nbytes)

    def _left(self, entry: Entry) -> None:
        with self._lock:
            if self._held.pop(entry.mm_hash, None) is None:
                return
            self._publish(EVICTED, entry.mm_hash, entry.nbytes)

    def _publish(self, kind: Literal["stored", "evicted"], mm_hash: str, nbytes: int) -> None:
        self._seq += 1
        self._stats["events"] += 1
        if len(self._queue) >= self._queue_max:
            self._stats["dropped"] += 1  # the sequence number is spent: a gap downstream
            return
        self._queue.append(ItemEvent(self.incarnation, self._seq, kind, mm_hash, nbytes))
        if len(self._queue) == 1:  # the thread drains it whole: one wake per batch is enough
            self._waker.wake()

    # -- the feed's thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        last_sent = time.monotonic()
        next_snapshot = last_sent + self._snapshot_s
        try:
            while not self._stopping:
                wait_s = max(
                    0.0, min(last_sent + self._heartbeat_s, next_snapshot) - time.monotonic()
                )
                ready = dict(poller.poll(int(wait_s * 1000) + 1))
                self._waker.clear()
                snapshot = False
                if self._socket in ready:
                    snapshot = self._take_subscriptions()
                with self._lock:
                    batch = list(self._queue)
                    self._queue.clear()
                for event in batch:
                    self._send(event)
                now = time.monotonic()
                if snapshot or now >= next_snapshot:
                    self._send_snapshot()
                    next_snapshot = now + self._snapshot_s
                elif not batch and now - last_sent >= self._heartbeat_s:
                    self._send_heartbeat()
                elif not batch:
                    continue
                last_sent = now
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("item feed failed; subscribers will see it as gone")
        finally:
            self._socket.close(0)

    def _take_subscriptions(self) -> bool:
        wanted = False
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return wanted
            if frame[:1] == b"\x01":
                with self._lock:
                    self._stats["subscriptions"] += 1
                wanted = True

    def _send_snapshot(self) -> None:
        with self._lock:
            snapshot = ItemSnapshot(self.incarnation, self._seq, tuple(self._held.items()))
        self._send(snapshot)
        with self._lock:
            self._stats["snapshots"] += 1

    def _send_heartbeat(self) -> None:
        with self._lock:
            seq = self._seq
        self._send(ItemHeartbeat(self.incarnation, seq))
        with self._lock:
            self._stats["heartbeats"] += 1

    def _send(self, message: FeedMessage) -> None:
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
            counter = "sent"
        except zmq.Again:  # XPUB drops at a subscriber's high-water mark rather than block
            counter = "dropped"
        with self._lock:  # the engine's threads count too
            self._stats[counter] += 1

    # -- owner side -------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: events, dropped, sent, snapshots, heartbeats, subscriptions, and
        refused (subscribers whose key is not on the allow-list)."""
        with self._lock:
            return {**self._stats, "refused": self._allow_list.rejected}

    def held(self) -> dict[str, int]:
        """The mirror of the store's index (mm_hash -> nbytes), a copy."""
        with self._lock:
            return dict(self._held)

    def close(self) -> None:
        """Idempotent: stops the watchers and the thread, closes the socket."""
        if self._stopping:
            return
        self._stopping = True
        for stop in self._unwatch:
            stop()
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._waker.close()
        if self._zap is not None:
            self._zap.close()


def feed_from_config(store: Store, config: Config) -> ItemFeed | None:
    """The feed `config.events_port` asks for, or None when it is unset."""
    if config.events_port is None:
        return None
    keys: KeyPair | None = None
    subscribers: frozenset[bytes] = frozenset()
    if config.insecure:
        log.warning(
            "ecshare: item events on port %s without CURVE: anyone who can reach "
            "it may subscribe (insecure=true)",
            config.events_port,
        )
    else:
        secret = config.server_secret_key_file or config.client_secret_key_file
        if not secret:
            raise ControlConfigError(
                "events_port: item events are served under CURVE and need this instance's "
                "server_secret_key_file (or client_secret_key_file)"
            )
        keys = load_keypair(secret)
        if config.admin_keys_file or config.admin_keys:
            subscribers = load_authorized_keys(config.admin_keys_file, config.admin_keys)
    return ItemFeed(
        store,
        host=config.listen_host,
        port=config.events_port,
        keys=keys,
        subscribers=subscribers,
    )
