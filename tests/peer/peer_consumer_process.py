"""A consumer that accepts pushes, in a process of its own, so that a test can
SIGKILL it in the middle of a push.

    python peer_consumer_process.py PRODUCER_ADDRESS [config flags]

It connects to the producer (its session is what the producer pushes over),
prints one ready line, and then reads commands from stdin:

    hold       stop progressing the data plane, so that a write into this
               region over UCX TCP cannot move (answers once held)
    stats      one JSON line: counters and store stats
    (EOF)      stop cleanly
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import msgspec

from ecshare.config import add_config_arguments, load_config
from ecshare.peer import Node, start_consumer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("producer")
    parser.add_argument("--fingerprint", default="ecshare-synthetic")
    add_config_arguments(parser)
    args = parser.parse_args()
    config = load_config(cli=args)
    node = Node.create(config, "consumer")
    consumer = start_consumer(node, fingerprint=args.fingerprint)
    held = threading.Event()
    real_progress = node.transport.progress

    def progress() -> list[tuple[str, bytes]]:
        return [] if held.is_set() else real_progress()

    node.transport.progress = progress  # type: ignore[method-assign]
    consumer.connect([args.producer])
    print("READY " + json.dumps({"push_name": config.push_name}), flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "hold":
                held.set()
                answer: dict[str, object] = {"held": True}
            elif words[0] == "stats":
                answer = {
                    "counters": consumer.counter_snapshot(),
                    "store": msgspec.structs.asdict(node.store.stats()),
                }
            else:
                answer = {"error": f"unknown command {words[0]!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        consumer.stop()
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
