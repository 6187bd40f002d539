"""Helpers for the tests that serve the tiny model with real `vllm serve` processes.

`start_proxy` runs `ecshare proxy` as operators do (a subprocess) and reads its ready
line; `single_instance_tokens` is the reference every EPD answer must equal: the same
request answered by one instance that encodes its images itself; `wait_metric` and
`delta` read the connector's counters (`vllm:ecshare_*`) on an instance's Prometheus
endpoint.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ecshare.apps.ready import ProxyReady, parse_ready
from ecshare.vllm.servers import VllmServer, post_chat, random_image_url, read_metrics


def token_ids(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert isinstance(ids, list) and ids, answer
    return ids


def wait_metric(
    server: VllmServer, key: str, at_least: float, timeout_s: float = 15.0
) -> dict[str, float]:
    """The server's ecshare metrics once `key` reaches `at_least`, or as they are at the timeout.

    vLLM's frontend records a step's stats while it streams the step's
    outputs, so a response can arrive a moment before its counters move.
    """
    return wait_metrics(server, {key: at_least}, timeout_s)


def wait_metrics(
    server: VllmServer, at_least: dict[str, float], timeout_s: float = 15.0
) -> dict[str, float]:
    """As `wait_metric`, until every key of `at_least` has reached its value. vLLM's
    frontend moves one counter after another, and a scrape may fall between them
    (items counted, their bytes not yet): wait for each counter a check reads."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        reached = all(metrics.get(k, 0.0) >= v for k, v in at_least.items())
        if reached or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def settled_metrics(
    server: VllmServer | str, quiet_s: float = 0.3, timeout_s: float = 10.0
) -> dict[str, float]:
    """The server's metrics (a server, or its URL) once two scrapes `quiet_s` apart agree:
    what an earlier request left moving (a save reported a step later, say) is counted by
    then."""
    url = server.url if isinstance(server, VllmServer) else server
    deadline = time.monotonic() + timeout_s
    metrics = read_metrics(url)
    while True:
        time.sleep(quiet_s)
        again = read_metrics(url)
        if again == metrics or time.monotonic() > deadline:
            return again
        metrics = again


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def fresh_images(*sizes: tuple[int, int]) -> list[str]:
    """Images no instance has seen (an instance that had would answer from its own
    encoder cache first), one per (width, height)."""
    seed = random.SystemRandom().randrange(1 << 40)
    return [random_image_url(seed + i, w, h) for i, (w, h) in enumerate(sizes)]


def single_instance_tokens(server: VllmServer, body: dict[str, Any]) -> list[int]:
    """The request's tokens from `server` alone: its images under uuids no encoder
    announced, so that it encodes them itself (checked on its counters)."""
    alone = copy.deepcopy(body)
    images = 0
    for part in (p for m in alone["messages"] for p in m["content"]):
        if part["type"] == "image_url":
            part["uuid"] = f"single-{random.getrandbits(64):x}-{images}"
            images += 1
    before = server.metrics()
    tokens = token_ids(post_chat(server.url, alone))
    key = "local_encodes_total"
    after = wait_metric(server, key, before.get(key, 0) + images)
    assert delta(after, before, key) == images  # it really encoded them
    return tokens


def start_proxy(
    encoder: str, prefill_decode: str, log: Path, *flags: str
) -> tuple[subprocess.Popen[str], str]:
    """`ecshare proxy` in front of `encoder` and `prefill_decode` (a `--pd` value) on a
    free port; the process and its URL. Its output goes to `log`."""
    return run_proxy(["--encoder", encoder, "--pd", prefill_decode, "--port", "0", *flags], log)


def run_proxy(argv: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    """`ecshare proxy *argv`, once it is ready: the process and its URL. Its output goes
    to `log`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecshare", "proxy", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        ready = parse_ready(line, ProxyReady)
        if ready is not None:
            break
    else:
        raise AssertionError("ecshare proxy did not get ready:\n" + "".join(lines[-30:]))

    def drain() -> None:  # keep its pipe from filling up
        with open(log, "w") as out:
            out.writelines(lines)
            for rest in proc.stdout or ():
                out.write(rest)

    threading.Thread(target=drain, daemon=True).start()
    return proc, ready.url


def wait_all_ready(servers: list[VllmServer]) -> None:
    """Wait until every one of `servers` is ready; on any failure, stop them all."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
