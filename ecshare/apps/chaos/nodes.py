"""The harness's child processes, and the parent's handle on each one.

A producer child is a real `Producer` (CURVE, NIXL) over a region filled with
synthetic entries (`fill_synthetic`), and it keeps "encoding" entries of its
working set that it lacks, so that a region smaller than the working set
evicts while consumers ask. A consumer child is a real `Consumer`; it fetches
what the parent asks for and checks every delivered entry against the bytes
its key names (`synthetic_bytes`) before it reports the outcome.

Children fork from `multiprocessing`'s fork server (see `ecshare.apps.bench.child`:
no NIXL or ZMQ state is ever forked). The parent may SIGKILL, SIGSTOP or SIGCONT
them at any moment; every wait on a child is bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import xxhash

from ecshare.apps.bench.child import ChildGone, ChildPipe, ChildProcess, Failed, Ready
from ecshare.apps.bench.synthetic import fill_synthetic, parse_spec, synthetic_bytes, synthetic_hash
from ecshare.apps.chaos.crashes import StderrTap, Stop, child_stderr
from ecshare.apps.chaos.hosts import become_host
from ecshare.apps.chaos.messages import (
    Arm,
    Command,
    ConsumerSpec,
    Event,
    Fetch,
    Fill,
    NodeStats,
    Outcome,
    ProducerSpec,
    Push,
    PushEnded,
    Quiesce,
    ReadInFlight,
    Stats,
)
from ecshare.config import Config
from ecshare.peer import (
    Consumer,
    FetchFailed,
    FetchItem,
    FetchResult,
    Node,
    PushOutcome,
    start_consumer,
    start_producer,
)
from ecshare.store import Entry, EntryState, Hold, Store, StoreError, StoreFull

# Owner name of the consumer's own check pins, so a check never races an eviction.
_CHECK_OWNER = "chaos-check"
# Owner of the pin each fetch asks for (`FetchItem.hold`): taken as the entry turns
# READY, so that a full region (`Fill`) cannot evict it before it is checked.
_HOLD_OWNER = "chaos-hold"
_CHECK_LEASE_S = 600.0
# How often an armed child looks for a large read in flight. A 4 MiB read over UCX
# TCP takes some 15 ms here; the look itself is a few dictionary lookups.
_ARM_POLL_S = 0.0005
# Numbers the entries of every fill in this process: a fill may come while an earlier
# one still holds its blocks (it gives them back after its `seconds`), and its names
# must not meet theirs.
_FILL_NUMBERS = itertools.count()


__all__ = ["Child", "ChildGone", "consumer_main", "producer_main", "working_set_keys"]


# -- in the child ----------------------------------------------------------------------------


class _Checker:
    """Expected content per key, as an xxh3-64 digest computed once."""

    def __init__(self) -> None:
        self._digests: dict[tuple[str, int], int] = {}

    def expected(self, mm_hash: str, nbytes: int) -> int:
        key = (mm_hash, nbytes)
        digest = self._digests.get(key)
        if digest is None:
            digest = xxhash.xxh3_64_intdigest(synthetic_bytes(mm_hash, nbytes).data)
            self._digests[key] = digest
        return digest

    def check(self, store: Store, mm_hash: str, nbytes: int, tag: str) -> bool | None:
        """True/False: the READY entry's bytes are/are not right; None: it is not READY."""
        try:
            store.pin(mm_hash, _CHECK_OWNER, tag, _CHECK_LEASE_S)
        except StoreError:
            return None
        try:
            entry = store.pinned_entry(_CHECK_OWNER, tag)
            assert entry is not None
            if entry.nbytes != nbytes:
                return False
            return store.checksum(entry) == self.expected(mm_hash, nbytes)
        finally:
            store.unpin(_CHECK_OWNER, tag)


def _stats(
    node: Node,
    counters: dict[str, int],
    keys: Iterable[tuple[str, int]],
    checker: _Checker,
    verify: bool,
    **extra: int,
) -> NodeStats:
    store = node.store
    try:
        store.check_invariants()
        invariant_error = ""
    except AssertionError as exc:
        invariant_error = str(exc) or "entry table invariant broken"
    used_by_ready = 0
    verified = 0
    wrong = []
    ready_keys: list[tuple[str, int]] = []
    for h, n in keys:
        entry = store.get(h)
        if entry is None or entry.state is not EntryState.READY:
            continue
        used_by_ready += entry.nblocks
        if len(ready_keys) < 16:
            ready_keys.append((h, n))
        if verify:
            ok = checker.check(store, h, n, f"stats-{h}")
            verified += ok is not None
            if ok is False:
                wrong.append(h)
    return NodeStats(
        pid=os.getpid(),
        store=store.stats(),
        counters=counters,
        invariant_error=invariant_error,
        used_by_ready=used_by_ready,
        verified=verified,
        wrong=wrong,
        ready_keys=ready_keys,
        **extra,
    )


def _arm(pipe: ChildPipe, cmd: Arm, in_flight: Callable[[], int]) -> None:
    """Watch on a thread of its own, so the child keeps serving, for the read `cmd` asks."""

    def watch() -> None:
        until = time.monotonic() + cmd.within_s
        while not (nbytes := in_flight()) and time.monotonic() < until:
            time.sleep(_ARM_POLL_S)
        frozen = cmd.freeze and nbytes > 0
        pipe.send(ReadInFlight(cmd.kind, nbytes, frozen))
        if frozen:
            # The whole process stops, its network thread with it: the read stays in
            # flight until the harness sends SIGCONT.
            os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=watch, name="chaos-arm", daemon=True).start()


def _watch(
    store: Store, keys: Iterable[tuple[str, int]], cmd: Arm, state: str
) -> Callable[[], int]:
    """A look for the largest read of `cmd.min_nbytes` or more in flight: its size, or 0.

    On a producer ("pinned") a grant pins the entry it lets a consumer read; on a
    consumer ("allocated") a read's destination stays ALLOCATED until it is committed.
    """
    large = sorted(((n, h) for h, n in keys if n >= cmd.min_nbytes), reverse=True)

    def look() -> int:
        for n, h in large:
            entry = store.get(h)
            if entry is None:
                continue
            if (state == "pinned" and entry.pins > 0) or (
                state == "allocated" and entry.state is EntryState.ALLOCATED
            ):
                return n
        return 0

    return look


def _fetching(store: Store, unsettled: dict[int, tuple[str, int]], cmd: Arm) -> Callable[[], int]:
    """A look for the largest fetch of `cmd.min_nbytes` or more in flight here (not
    settled, and not READY locally): its size, or 0."""

    def look() -> int:
        largest = 0
        for h, n in list(unsettled.values()):
            if n >= cmd.min_nbytes and n > largest:
                entry = store.get(h)
                if entry is None or entry.state is not EntryState.READY:
                    largest = n
        return largest

    return look


def _push_ended(pipe: ChildPipe, push_id: int, t0: float, future: Future[PushOutcome]) -> None:
    out = future.result()  # a push's future never raises
    pipe.send(PushEnded(push_id, out.state.value, out.detail[:300], time.monotonic() - t0))


def _at_least(look: Callable[[], int], cmd: Arm) -> int:
    n = look()
    return n if n >= cmd.min_nbytes else 0


def _reserved(consumer: Consumer, keys: Iterable[tuple[str, int]], cmd: Arm) -> Callable[[], int]:
    """A look for the largest push of `cmd.min_nbytes` or more with blocks reserved here."""
    large = sorted(((n, h) for h, n in keys if n >= cmd.min_nbytes), reverse=True)

    def look() -> int:
        return next((n for n, h in large if consumer.push_pending(h)), 0)

    return look


def _fill(store: Store, seconds: float) -> None:
    """Take every block there is (evicting what may be evicted) in half-written entries,
    and give them back after `seconds`."""
    taken: list[Entry] = []
    while True:
        name = f"chaos-fill-{os.getpid()}-{next(_FILL_NUMBERS)}"
        try:
            taken.append(store.allocate(name, store.block_size))
        except StoreFull:
            break

    def give_back() -> None:
        for entry in taken:
            with contextlib.suppress(StoreError):
                store.abort(entry)

    timer = threading.Timer(seconds, give_back)
    timer.daemon = True
    timer.start()


def producer_main(conn: Connection, spec: ProducerSpec) -> None:
    pipe = ChildPipe(conn)
    try:
        config = Config.from_dict(spec.config)
        node = Node.create(config, "producer")
    except Exception as exc:
        pipe.send(Failed(f"producer did not start: {exc!r}"))
        return
    try:
        entries = fill_synthetic(node.store, spec.working_set)
        keys = [(str(e["mm_hash"]), int(e["nbytes"])) for e in entries]
        producer = start_producer(node, fingerprint=spec.fingerprint)
    except Exception as exc:  # a port still held by a dying predecessor, say
        pipe.send(Failed(f"producer did not start: {exc!r}"))
        node.close()
        return
    churn_stop = threading.Event()
    churn_counts: dict[str, int] = {"churn_puts": 0, "churn_store_full": 0}

    def churn() -> None:
        rng = random.Random(spec.seed)
        while not churn_stop.wait(1.0 / spec.churn_per_s):
            h, n = rng.choice(keys)
            if node.store.get(h) is not None:
                continue
            try:
                node.store.put(h, synthetic_bytes(h, n))  # evicts LRU unpinned entries
                churn_counts["churn_puts"] += 1
            except StoreFull:  # everything left is pinned: a busy producer, not an error
                churn_counts["churn_store_full"] += 1

    churner = threading.Thread(target=churn, name="chaos-churn", daemon=True)
    if spec.churn_per_s > 0:
        churner.start()
    pipe.send(Ready(os.getpid(), producer.address, producer.port))
    checker = _Checker()
    try:
        for cmd in pipe.commands():
            if isinstance(cmd, Quiesce):
                churn_stop.set()
                if churner.is_alive():
                    churner.join()
                pipe.send(Ready(os.getpid(), producer.address, producer.port))
            elif isinstance(cmd, Stats):
                counters = {**producer.counters, **churn_counts}
                pipe.send(
                    _stats(
                        node,
                        counters,
                        keys,
                        checker,
                        cmd.verify,
                        active_grants=producer.active_grants(),
                        sessions=producer.session_count(),
                    )
                )
            elif isinstance(cmd, Push):
                for push_id, h in cmd.items:
                    future = producer.push(h, to=cmd.to)
                    future.add_done_callback(partial(_push_ended, pipe, push_id, time.monotonic()))
            elif isinstance(cmd, Arm):
                if cmd.push:
                    _arm(pipe, cmd, partial(_at_least, producer.largest_push_in_flight, cmd))
                else:
                    _arm(pipe, cmd, _watch(node.store, keys, cmd, "pinned"))
    finally:
        churn_stop.set()
        if churner.is_alive():
            churner.join()
        producer.stop()
        node.close()


def consumer_main(conn: Connection, spec: ConsumerSpec) -> None:
    pipe = ChildPipe(conn)
    try:
        config = Config.from_dict(spec.config)
        node = Node.create(config, "consumer")
    except Exception as exc:
        pipe.send(Failed(f"consumer did not start: {exc!r}"))
        return
    try:
        consumer = start_consumer(node, fingerprint=spec.fingerprint)
    except Exception as exc:
        pipe.send(Failed(f"consumer did not start: {exc!r}"))
        node.close()
        return
    if spec.peers:
        consumer.connect(spec.peers)
    checker = _Checker()
    # Every key asked for or pushed here, for the final sweep.
    fetched: dict[str, int] = dict(working_set_keys(spec.working_set)) if spec.working_set else {}
    settled: queue.Queue[tuple[int, str, int, float, float, Future[FetchResult]] | None] = (
        queue.Queue()
    )

    # Fetches asked for and not settled, by id: (mm_hash, nbytes). Written by this
    # thread and the network thread, read by an armed watch (one dict op each).
    unsettled: dict[int, tuple[str, int]] = {}

    def on_settled(fetch_id: int, h: str, n: int, t0: float, future: Future[FetchResult]) -> None:
        # Runs on the consumer's network thread: note the time, check elsewhere.
        now = time.monotonic()
        unsettled.pop(fetch_id, None)
        settled.put((fetch_id, h, n, now - t0, now, future))

    def check_loop() -> None:
        while (item := settled.get()) is not None:
            pipe.send(_outcome(node.store, checker, *item))

    checker_thread = threading.Thread(target=check_loop, name="chaos-check", daemon=True)
    checker_thread.start()
    pipe.send(Ready(os.getpid()))
    try:
        for cmd in pipe.commands():
            if isinstance(cmd, Fetch):
                t0 = time.monotonic()
                items = [
                    FetchItem(h, n, pushed=cmd.pushed, hold=Hold(_HOLD_OWNER, f"fetch-{i}", 600.0))
                    for i, h, n in cmd.items
                ]
                for (fetch_id, h, n), future in zip(
                    cmd.items, consumer.fetch(items, cmd.peers), strict=True
                ):
                    fetched[h] = n
                    unsettled[fetch_id] = (h, n)
                    future.add_done_callback(partial(on_settled, fetch_id, h, n, t0))
            elif isinstance(cmd, Stats):
                pipe.send(
                    _stats(node, dict(consumer.counters), fetched.items(), checker, cmd.verify)
                )
            elif isinstance(cmd, Fill):
                _fill(node.store, cmd.seconds)
            elif isinstance(cmd, Arm):
                if cmd.push:
                    _arm(pipe, cmd, _reserved(consumer, list(fetched.items()), cmd))
                elif cmd.fetch:
                    _arm(pipe, cmd, _fetching(node.store, unsettled, cmd))
                else:
                    _arm(pipe, cmd, _watch(node.store, fetched.items(), cmd, "allocated"))
    finally:
        consumer.stop()
        settled.put(None)
        checker_thread.join(timeout=30)
        node.close()


def _outcome(
    store: Store,
    checker: _Checker,
    fetch_id: int,
    h: str,
    n: int,
    settle_s: float,
    settled_at: float,
    future: Future[FetchResult],
) -> Outcome:
    error = future.exception()
    if isinstance(error, FetchFailed):
        reason, detail = error.reason.value, error.detail[:300]
        return Outcome(fetch_id, h, "failed", settle_s, reason, detail, settled_at)
    if error is not None:  # anything but a typed failure breaks the contract
        kind, detail = type(error).__name__, str(error)[:300]
        return Outcome(fetch_id, h, "untyped", settle_s, kind, detail, settled_at)
    result = future.result()
    try:
        ok = checker.check(store, h, n, f"fetch-{fetch_id}") if result.nbytes == n else False
    finally:
        store.unpin(_HOLD_OWNER, f"fetch-{fetch_id}")
    if ok is None:
        return Outcome(fetch_id, h, "vanished", settle_s, settled_at=settled_at)
    # The copy is dropped once checked, so the next fetch of the key crosses the
    # network again (and a wrong copy is counted once, not served locally later).
    with contextlib.suppress(StoreError):
        store.remove(h)
    status = "delivered" if ok else "corrupted"
    return Outcome(
        fetch_id,
        h,
        status,
        settle_s,
        detail=result.peer,
        settled_at=settled_at,
        pushed=result.pushed,
    )


def working_set_keys(spec: str) -> list[tuple[str, int]]:
    """The (mm_hash, nbytes) of every entry a producer's working set names."""
    return [(synthetic_hash(n, i), n) for n, count in parse_spec(spec) for i in range(count)]


# -- in the parent ---------------------------------------------------------------------------


class Child(ChildProcess):
    """One node's child process, and the faults the fleet holds it under."""

    def __init__(
        self,
        role: str,
        index: int,
        target: Callable[[Connection, Any], None],
        spec: ProducerSpec | ConsumerSpec,
        on_event: Callable[[Child, Outcome | PushEnded | ReadInFlight], None],
        *,
        start_timeout_s: float,
        verbose: bool = False,
        stderr: StderrTap | None = None,
    ) -> None:
        self.role = role
        self.index = index
        self.armed = ""  # the fault kind it was armed for (`Arm`), until it answers
        self.strike_s = 0.0  # how long that fault lasts once it strikes
        self.push_name = ""  # a consumer's: the name producers push to it by
        self.push_shrunk = False  # a consumer under SHRUNK_PUSH_DEADLINE_S
        self.struck_kill = False  # SIGKILLed by a fault that waited for a push in flight
        # The fault that stopped it and when, until SIGCONT; then the stop is in `stops`.
        self.stopped_by: tuple[str, float] | None = None
        self.stops: list[Stop] = []
        self.stderr = stderr  # its stderr, when the harness reads it (`StderrTap`)
        self._on_event = on_event
        try:
            super().__init__(
                role,
                _child_entry,
                (target, spec, verbose, str(stderr.path) if stderr else ""),
                process_name=f"ecshare-chaos-{role}-{index}",
                start_timeout_s=start_timeout_s,
            )
        except BaseException:
            if stderr is not None:
                stderr.close()
            raise
        if stderr is not None:
            stderr.start()
        self.ready: Ready

    @property
    def name(self) -> str:
        return f"{self.role} {self.index} (pid {self.process.pid})"

    def answers(self) -> bool:
        """Alive, and neither stopped nor about to stop itself: a call gets its answer."""
        return self.alive() and not self.paused and not self.armed

    def _unasked(self, event: Any) -> bool:
        if isinstance(event, Outcome | PushEnded | ReadInFlight):
            self._on_event(self, event)
            return True
        return False

    def call(self, cmd: Command, timeout_s: float) -> Event:
        reply: Event = super().call(cmd, timeout_s)
        return reply

    def stats(self, timeout_s: float, *, verify: bool = False) -> NodeStats:
        reply = self.call(Stats(verify=verify), timeout_s)
        if not isinstance(reply, NodeStats):
            raise ChildGone(f"{self.name}: answered Stats with {reply}")
        return reply


def _child_entry(
    conn: Connection,
    target: Callable[[Connection, Any], None],
    spec: ProducerSpec | ConsumerSpec,
    verbose: bool,
    stderr_path: str,
) -> None:
    if stderr_path:
        child_stderr(stderr_path)  # before anything can write there
    # The harness's terminal may send SIGINT to the whole group; the parent decides
    # when its children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.netns:
        # Before any socket exists: every one this process opens lives in its "host".
        become_host(spec.netns)
    # Under injected faults, peer failures and refused connections are the point;
    # the report counts them, so only errors are logged unless asked.
    logging.basicConfig(
        level=logging.WARNING if verbose else logging.ERROR,
        format=f"%(asctime)s {os.getpid()} %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    # UCX logs to stdout by default, where `ecshare chaos --json` prints its report.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    target(conn, spec)
