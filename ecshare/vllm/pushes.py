"""The encoder side of push: write each item into the prefill/decode instance that will
serve the request, while the encoder's answer, the proxy hop and that instance's
preprocessing are still under way (docs/PUSH.md).

A request asks for it in its own `ec_transfer_params`, which only the proxy
writes (it drops what a client wrote):

    {"push_to": ["pd0"]}        consumer push names (`push_name`), at most MAX_PUSH_NAMES

The encoder pushes to a name only when both
- its own `push_targets` allow it (any name, when unset; `settings`), and
- a consumer holds a session with it that accepts pushes under that name now
  (`Producer.push_names`): authenticated by CURVE with a key on this
  producer's `authorized_keys`, and trusting this producer's key to push
  (`push_trusted_keys` on the consumer).
Any other name is dropped and counted (`push_names_refused`); a malformed
`push_to` is counted (`push_params_unusable`) and nothing is pushed. Neither
fails the request: the consumer pulls the item, as it does without push.

Each announced item's params then say where a push of it was started
(`pushed_to`), so that the consumer of that name waits for the push rather
than pulling at once. `Producer.push` only queues: the offer, the write and
the report run on the producer's network thread. An item READY when its
request finishes is pushed then; one whose copy into the region is still to be
reported is pushed as its save commits (`on_saves_applied`, on whichever
thread applies the workers' report, and once a step). The producer counts how each push ended
(`pushes_written`, `pushes_refused`); one that does not land costs the
consumer a pull, never the request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ecshare.peer import Producer, PushOutcome
from ecshare.protocol import MAX_PUSH_NAMES, ParamsError, decode_push_request
from ecshare.store import EntryState, Store
from ecshare.vllm.settings import ConnectorSettings
from ecshare.vllm.tally import Tally

log = logging.getLogger(__name__)

PUSH_TO = "push_to"  # in the encoder request's ec_transfer_params
PUSHED_TO = "pushed_to"  # in each announced item's params


def requested_names(params: object) -> tuple[str, ...] | None:
    """The push names a request's params ask for; () when none, None when malformed."""
    if not isinstance(params, Mapping) or PUSH_TO not in params:
        return ()
    try:
        request = decode_push_request(params)
    except ParamsError:
        return None
    return tuple(dict.fromkeys(request.push_to))


class Pushes:
    """The encoder's pushes asked for by finished requests. Thread-safe."""

    def __init__(
        self,
        producer: Producer,
        store: Store,
        settings: ConnectorSettings,
        tally: Tally,
    ) -> None:
        self._producer = producer
        self._store = store
        self._settings = settings
        self._tally = tally
        self._lock = threading.Lock()
        self._after_save: dict[str, set[str]] = {}  # mm_hash -> names, pushed on commit

    def names_for(self, rid: str, params: Any) -> tuple[str, ...]:
        """The names this request's items are pushed to (see the module docstring)."""
        asked = requested_names(params)
        if asked is None:
            self._tally.add("push_params_unusable")
            self._tally.warn(
                "push",
                f"request {rid}: {PUSH_TO} is not a list of at most {MAX_PUSH_NAMES} push names",
            )
            return ()
        if not asked:
            return ()
        live = self._producer.push_names()
        names = tuple(n for n in asked if self._settings.may_push_to(n) and n in live)
        if len(names) < len(asked):
            refused = [n for n in asked if n not in names]
            self._tally.add("push_names_refused", len(refused))
            self._tally.warn(
                "push_name",
                f"request {rid}: not pushing to {refused}: not in push_targets, or no "
                "consumer of that name holds a push session",
            )
        return names

    def push(self, mm_hash: str, names: tuple[str, ...]) -> None:
        """Push `mm_hash` to `names` now if it is READY, else once its save commits."""
        with self._lock:
            entry = self._store.get(mm_hash)
            if entry is None:
                return  # not stored: nothing to push (nor announced)
            if entry.state is not EntryState.READY:
                # Being copied in, or committed by the report being applied right now.
                self._after_save.setdefault(mm_hash, set()).update(names)
                return
        for name in names:
            self._start(mm_hash, name)

    def on_saves_applied(self) -> None:
        """Start the pushes waiting for saves that have now committed; drop those whose
        save failed or was abandoned (the consumer's pull fails too, and it encodes)."""
        ready: list[tuple[str, set[str]]] = []
        with self._lock:
            for h in list(self._after_save):
                entry = self._store.get(h)
                if entry is not None and entry.state is EntryState.READY:
                    ready.append((h, self._after_save.pop(h)))
                elif entry is None or entry.state is not EntryState.ALLOCATED:
                    del self._after_save[h]
        for h, names in ready:
            for name in sorted(names):
                self._start(h, name)

    def waiting(self) -> int:
        """Items whose pushes wait for their save to commit (for tests and tools)."""
        with self._lock:
            return len(self._after_save)

    def _start(self, mm_hash: str, name: str) -> None:
        try:
            future = self._producer.push(mm_hash, name)
        except RuntimeError as exc:  # a producer that stopped: the consumer pulls
            log.warning("ecshare: not pushing %s to %s: %s", mm_hash, name, exc)
            return
        self._tally.add("pushes_started")
        future.add_done_callback(_log_outcome)


def _log_outcome(future: Future[PushOutcome]) -> None:
    """The producer counts outcomes (`pushes_written`, `pushes_refused`); say why one
    did not land."""
    outcome = future.result()
    if not outcome.pushed:
        log.info(
            "ecshare: push of %s to %s %s (%s); the consumer pulls it",
            outcome.mm_hash,
            outcome.to,
            outcome.state.value,
            outcome.detail,
        )
