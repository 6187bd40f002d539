"""A real instance's item feed, in a process of its own: a store and its `ItemFeed`.

Reads one JSON line of settings on stdin ({"port", "secret_key_file", "subscribers",
"queue_max"}), prints `port N`, then takes one command per line and answers each with one
JSON line {"held": [...], "seq": N, "stats": {...}}:

    put H           store an entry under H
    evict H         remove the entry under H
    flood N         store f0..fN-1 and remove them all, as fast as the store takes it
    state           nothing; just answer
"""

from __future__ import annotations

import json
import sys

import numpy as np

from ecshare.control import load_keypair
from ecshare.peer.items import ItemFeed
from ecshare.store import Region, Store


def main() -> None:
    settings = json.loads(sys.stdin.readline())
    region = Region.create(4 << 20, name="feed-child", prefault=False)
    store = Store(region, 4096)
    feed = ItemFeed(
        store,
        host="127.0.0.1",
        port=settings["port"],
        keys=load_keypair(settings["secret_key_file"]),
        subscribers=frozenset(k.encode("ascii") for k in settings["subscribers"]),
        queue_max=settings.get("queue_max", 65536),
    )
    print(f"port {feed.port}", flush=True)
    payload = np.ones(100, dtype=np.uint8)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "put":
            store.put(arg, payload)
        elif command == "evict":
            store.remove(arg)
        elif command == "flood":
            names = [f"f{i}" for i in range(int(arg))]
            for name in names:
                store.put(name, payload)
            for name in names:
                store.remove(name)
        held = sorted(feed.held())
        answer = {"held": held, "stats": feed.stats(), "incarnation": feed.incarnation}
        print(json.dumps(answer), flush=True)
    feed.close()
    region.close()


if __name__ == "__main__":
    main()
