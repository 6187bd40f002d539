"""A producer process with test hooks: `ecshare serve`, plus commands on stdin.

It starts exactly as `python -m ecshare serve` does (same flags, same ready line)
and then reads one command per line from stdin:

    stats              print one JSON line: counters, store stats, grants, sessions,
                       each session's grant ids, the control server's counters
    stall SECONDS      block the producer's network thread for SECONDS (answers once
                       it is blocked)
    stall-on-grant SECONDS
                       the same, as soon as a grant is outstanding
    push HASH NAME     push entry HASH to the consumer that accepts pushes as NAME
                       (answers at once; the push runs on)
    put HASH NBYTES    commit a new entry of synthetic bytes (its sessions that read
                       directly are told where it lies); a full region answers an error
    remove HASH        drop an entry (now, or when its last pin goes)
    hold / resume      stop / restart moving the data plane (reads from us over UCX
                       TCP stand still) while the control plane goes on serving
    (EOF)              stop cleanly

Each command answers with one JSON line, so a test can wait for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import msgspec

from ecshare.apps.bench.synthetic import fill_synthetic, synthetic_bytes
from ecshare.apps.ready import ProducerReady, ServedEntry, print_ready
from ecshare.config import add_config_arguments, load_config
from ecshare.peer import Node, Producer, start_producer
from ecshare.store import StoreError


def _stats(node: Node, producer: Producer) -> dict[str, object]:
    return {
        "counters": dict(producer.counters),
        "store": msgspec.structs.asdict(node.store.stats()),
        "active_grants": producer.active_grants(),
        "sessions": producer.session_count(),
        "grants": producer.grants_by_session(),
        "control": producer.control_stats,
        "pushes_in_flight": producer.pushes_in_flight(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--synthetic", default="")
    parser.add_argument("--fingerprint", default="ecshare-synthetic")
    add_config_arguments(parser)
    args = parser.parse_args()
    config = load_config(cli=args)
    node = Node.create(config, "producer")
    entries = fill_synthetic(node.store, args.synthetic)
    producer = start_producer(node, fingerprint=args.fingerprint)
    stall = threading.Event()
    stalling = threading.Event()
    on_grant = threading.Event()
    stall_s = [0.0]
    held = threading.Event()
    real_progress = node.transport.progress

    def progress() -> list[tuple[str, bytes]]:
        # Runs on the producer's network thread: sleeping here stalls it, and with
        # it the data plane (a READ over UCX's TCP transport moves only as the
        # target progresses).
        if stall.is_set() and (not on_grant.is_set() or producer.active_grants()):
            stall.clear()
            stalling.set()
            time.sleep(stall_s[0])
        return [] if held.is_set() else real_progress()

    node.transport.progress = progress  # type: ignore[method-assign]
    served = tuple(ServedEntry(str(e["mm_hash"]), int(e["nbytes"])) for e in entries)
    print_ready(ProducerReady(producer.address, served, producer.metrics_url))
    try:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "stats":
                answer: dict[str, object] = _stats(node, producer)
            elif words[0] == "stall":
                stall_s[0] = float(words[1])
                on_grant.clear()
                stalling.clear()
                stall.set()
                # Answer once the network thread is asleep (it progresses at least
                # every reap interval).
                answer = {"stalling": stalling.wait(timeout=10.0)}
            elif words[0] == "stall-on-grant":
                stall_s[0] = float(words[1])
                on_grant.set()
                stalling.clear()
                stall.set()
                answer = {"armed": True}
            elif words[0] == "put":
                try:
                    node.store.put(words[1], synthetic_bytes(words[1], int(words[2])))
                    answer = {"put": words[1]}
                except StoreError as exc:
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
            elif words[0] in ("hold", "resume"):
                (held.set if words[0] == "hold" else held.clear)()
                answer = {"held": held.is_set()}
            elif words[0] == "remove":
                node.store.remove(words[1])
                answer = {"removed": words[1]}
            elif words[0] == "push":
                producer.push(words[1], to=words[2])
                answer = {"pushing": words[1]}
            else:
                answer = {"error": f"unknown command {words[0]!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        producer.stop()
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
