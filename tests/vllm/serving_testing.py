"""Helpers for the tests that serve the tiny model with real `vllm serve` processes.

`start_proxy` runs `ecshare proxy` as operators do (a subprocess) and reads its ready
line; `single_instance_tokens` is the reference every EPD answer must equal: the same
request answered by one instance that encodes its images itself; `wait_metric` and
`delta` read the connector's counters (`vllm:ecshare_*`) on an instance's Prometheus
endpoint; `EarlyStart` starts a module's instances before its turn (see its docstring).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from ecshare.apps.ready import ProxyReady, parse_ready
from ecshare.vllm.servers import VllmServer, ensure_tiny_model, post_chat, random_image_url

_T = TypeVar("_T")
TINY_MODEL_DIR = Path(__file__).resolve().parents[2] / ".work" / "tiny-qwen2vl"
# Niceness of instances started before their module's turn: they take what CPU the
# tests running meanwhile leave, and yield it to them.
BACKGROUND_NICE = 19


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
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if metrics.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


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
    command = [
        sys.executable, "-m", "ecshare", "proxy", "--encoder", encoder, "--pd", prefill_decode,
        "--port", "0", *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
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


@dataclass
class Starting(Generic[_T]):
    """What a module's start function made: its `vllm serve` instances, started and maybe
    not yet ready, and whatever else its fixture needs (`value`)."""

    value: _T
    servers: list[VllmServer]


class EarlyStart(Generic[_T]):
    """A module's instances, started before the module's turn where the run has a core
    to spare.

    A vLLM start-up is tens of seconds of imports on one core per instance, while the
    tests before a module's turn leave most of a second core idle (they wait on sockets,
    leases and deadlines). A module defines `early_start = EarlyStart(name, start)` at
    its top level; tests/conftest.py calls `start()` once the instances of every
    earlier module that serves vLLM are gone (so that few instances live at once), and
    the module's fixture calls `take()`. The instances start at niceness
    BACKGROUND_NICE and are set back to 0 when taken, so that the module's own tests
    see them as if its fixture had started them; nothing about them differs otherwise.
    Where nothing started them early, `take()` starts them then.
    """

    def __init__(self, name: str, start: Callable[[Path, Path], Starting[_T]]) -> None:
        self._name = name
        self._start = start
        self._started: Starting[_T] | None = None
        self._taken = False

    def start(self, tmp_path_factory: pytest.TempPathFactory, nice: int = BACKGROUND_NICE) -> None:
        """Start the instances at niceness `nice`, unless they are started or were taken.
        Only a process that may lower a niceness again (root) starts them niced; any
        other leaves them to `take()`."""
        if self._started is not None or self._taken or (nice > 0 and os.geteuid() != 0):
            return
        model = ensure_tiny_model(TINY_MODEL_DIR)
        self._started = self._start(tmp_path_factory.mktemp(self._name), model)
        _renice(self._started.servers, nice)

    def take(self, tmp_path_factory: pytest.TempPathFactory) -> Starting[_T]:
        """The started instances, now the caller's to wait for and stop."""
        self.start(tmp_path_factory, nice=0)
        started, self._started, self._taken = self._started, None, True
        assert started is not None, f"{self._name}: taken twice"
        _renice(started.servers, 0)
        return started

    def close(self) -> None:
        """Stop instances started early and never taken (their module did not run)."""
        started, self._started = self._started, None
        for server in started.servers if started is not None else ():
            server.stop()


def _renice(servers: list[VllmServer], nice: int) -> None:
    """Every process of each instance: its process group (the API server's session)."""
    for server in servers:
        if server.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PGRP, server.proc.pid, nice)


def wait_all_ready(servers: list[VllmServer]) -> None:
    """Wait until every one of `servers` is ready; on any failure, stop them all."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
