"""The ready line: what a started ecshare process prints once it serves.

A process that supervises another (a test, the demos, `ecshare launch`, the proxy's
worker supervisor, `ecshare bench proxy`) reads the child's standard output until a line
starts with `READY_PREFIX`. The rest of that line is one JSON object, a `Ready` tagged by
`kind`, which says where the child listens:

* `producer`: `ecshare serve`, a producer and the entries it holds;
* `proxy`: `ecshare proxy` (or one of its workers);
* `launch`: `ecshare launch`, the proxy in front of the instances it started;
* `stubs`: the instant backends of `ecshare bench proxy`.

Every process prints the same prefix, and a reader names the kind it expects: a line of
another kind, or of another shape, raises `msgspec.ValidationError`.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

READY_PREFIX = "ecshare-ready "


class Ready(msgspec.Struct, frozen=True, tag_field="kind"):
    """What every ready line is; its subclasses say what each kind of process tells."""


class ServedEntry(msgspec.Struct, frozen=True):
    mm_hash: str
    nbytes: int


class ProducerReady(Ready, frozen=True, tag="producer"):
    address: str  # the control-plane endpoint
    entries: tuple[ServedEntry, ...]
    metrics: str | None  # the Prometheus endpoint's URL, when one serves


class ProxyReady(Ready, frozen=True, tag="proxy"):
    url: str
    encoders: tuple[str, ...]
    prefill_decode: tuple[str, ...]
    api_key: bool
    loop: str
    pids: tuple[int, ...]  # the processes that serve requests: one per worker


class InstancePorts(msgspec.Struct, frozen=True):
    """Where one instance of a launch listens."""

    url: str  # vLLM's API
    metrics: str  # vLLM's /metrics, the connector's vllm:ecshare_* series among them
    control: str | None = None  # an encoder's control plane (ZMQ, CURVE)
    events: str | None = None  # its item events (ZMQ, CURVE), for the proxy's directory


class LaunchReady(Ready, frozen=True, tag="launch"):
    url: str  # the proxy's
    model: str
    encoders: tuple[str, ...]
    prefill_decode: tuple[str, ...]  # prefill instances where `decode` is set
    workdir: str
    decode: tuple[str, ...] = ()  # decode instances (--prefill/--decode)
    # Each prefill/decode instance's push name, in the order of `prefill_decode`;
    # empty with --no-push.
    push_names: tuple[str, ...] = ()
    # The port every instance publishes its item events on (the proxy's --events-port).
    events_port: int | None = None
    metrics: str = ""  # the proxy's /metrics
    instances: dict[str, InstancePorts] = {}  # by name: encoder0, prefill_decode0, ...


class StubsReady(Ready, frozen=True, tag="stubs"):
    urls: dict[str, str]  # by role


AnyReady = TypeVar("AnyReady", bound=Ready)


def ready_line(ready: Ready) -> str:
    """The whole ready line for `ready`, without its newline."""
    return READY_PREFIX + msgspec.json.encode(ready).decode()


def print_ready(ready: Ready) -> None:
    """Print the ready line, flushed at once: the supervisor is waiting on it."""
    print(ready_line(ready), flush=True)


def parse_ready(line: str, kind: type[AnyReady]) -> AnyReady | None:
    """The `kind` that `line` announces, or None when it is not a ready line."""
    if not line.startswith(READY_PREFIX):
        return None
    return msgspec.json.decode(line[len(READY_PREFIX) :].strip(), type=kind)
