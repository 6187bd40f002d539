"""Helpers and fixtures for the peer-layer tests: real processes, sockets and NIXL.

Producers run as `python -m ecshare serve` or as peer_producer_process.py (the same,
plus stdin hooks), or in this process where a test must watch the producer's pins.
Consumers run in this process unless a test kills them. Every child is killed at
teardown, whatever the test did.

The fixtures are registered by this directory's conftest.py; test modules import
the helpers from here (a uniquely named module, unlike conftest).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np
import pytest

from ecshare import protocol as p
from ecshare.apps.bench.synthetic import synthetic_bytes
from ecshare.apps.chaos.options import TIMING
from ecshare.apps.ready import ProducerReady, ServedEntry, parse_ready
from ecshare.config import Config
from ecshare.control import (
    ControlClient,
    ControlServer,
    KeyPair,
    LinkSettings,
    generate_keypair,
    load_keypair,
)
from ecshare.peer import Consumer, Node, Producer, start_consumer, start_producer
from ecshare.peer.dataplane import announced
from ecshare.transport import NixlTransport
from ecshare.vllm.servers import popen_session

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HOOK_SCRIPT = HERE / "peer_producer_process.py"
FINGERPRINT = "ecshare-peer-tests"
MiB = 1 << 20

# Short timeouts everywhere, so that failures show within seconds: the chaos
# harness's timing (the consumer's deadline cap stays under the lease).
FAST: dict[str, Any] = {"region_bytes": 64 * MiB, **TIMING}
# The same for a control connection driven by hand (`RawSession`).
RAW_LINK = LinkSettings(heartbeat_ivl_s=0.2, heartbeat_timeout_s=1.0, handshake_timeout_s=1.0)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: this one, on the loopback device, no ECSHARE_* leaks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECSHARE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["UCX_NET_DEVICES"] = "lo"
    env.update(extra or {})
    return env


def flags(config: Mapping[str, Any]) -> list[str]:
    """Config values as `ecshare serve` / `ecshare fetch` command-line flags."""
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def expected(mm_hash: str, nbytes: int) -> np.ndarray:
    return synthetic_bytes(mm_hash, nbytes)


def stored_bytes(node: Node, mm_hash: str) -> np.ndarray:
    return np.asarray(node.store.read(mm_hash)).reshape(-1).view(np.uint8)


def granted(reply: p.Message) -> p.ItemReply:
    """The one item of a FetchReply, which must have been granted."""
    assert isinstance(reply, p.FetchReply), reply
    (item,) = reply.items
    assert item.status is p.ItemStatus.GRANTED, item
    return item


# A producer that a test stalls by holding back its own progress calls
# (`throttle_progress`): its data plane moves by them alone, so no NIXL progress
# thread; over UCX TCP, where reads are asynchronous; with the store canary on.
STALLABLE_TCP: dict[str, Any] = {
    "ucx_tls": "tcp",
    "store_canary": True,
    "nixl_progress_thread": False,
}


def throttle_progress(node: Node, producer: Producer, pause: Callable[[], None]) -> None:
    """Run `pause` before each data-plane progress call while the producer has grants."""
    progress = node.transport.progress

    def throttled() -> list[tuple[str, bytes]]:
        if producer.active_grants():
            pause()
        return progress()

    node.transport.progress = throttled  # type: ignore[method-assign]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event a throttled producer waits on; set at teardown, so that no producer
    thread is left waiting."""
    event = threading.Event()
    yield event
    event.set()


def stays(predicate: Callable[[], bool], loop: Any, passes: int = 3, window_s: float = 0.3) -> bool:
    """Whether `predicate` holds at every look until `loop` (a Consumer: anything with a
    `passes` count) has finished `passes` more passes and `window_s` has gone by.

    A check that nothing happened proves nothing before the loop that would do it has
    run: the first pass counted may have begun before this call, the second did not, so
    `passes` >= 2 ensure the loop looked at the state as it stands now.
    """
    start = loop.passes
    deadline = time.monotonic() + window_s
    while True:
        if not predicate():
            return False
        if loop.passes >= start + passes and time.monotonic() >= deadline:
            return True
        if time.monotonic() >= deadline + 10.0:
            raise AssertionError(f"the loop made {loop.passes - start} of {passes} passes")
        time.sleep(0.01)


# -- keys ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyring:
    dir: Path
    producer_secret: Path
    producer_public: Path
    consumer_secret: Path
    consumer_public: Path  # the producers' allow-list
    stranger_secret: Path  # a valid key pair nobody authorized
    consumer: KeyPair
    producer: KeyPair

    def producer_config(self) -> dict[str, Any]:
        return {
            "server_secret_key_file": str(self.producer_secret),
            "authorized_keys_file": str(self.consumer_public),
        }

    def consumer_config(self, *, stranger: bool = False) -> dict[str, Any]:
        secret = self.stranger_secret if stranger else self.consumer_secret
        return {
            "client_secret_key_file": str(secret),
            "server_public_key_file": str(self.producer_public),
        }


@pytest.fixture(scope="session")
def keyring(tmp_path_factory: pytest.TempPathFactory) -> Keyring:
    root = tmp_path_factory.mktemp("keys")
    prod = generate_keypair(root, "producer")
    cons = generate_keypair(root, "consumer")
    stranger = generate_keypair(root, "stranger")
    return Keyring(
        dir=root,
        producer_secret=prod.secret_path,
        producer_public=prod.public_path,
        consumer_secret=cons.secret_path,
        consumer_public=cons.public_path,
        stranger_secret=stranger.secret_path,
        consumer=load_keypair(cons.secret_path),
        producer=load_keypair(prod.secret_path),
    )


# -- producer processes --------------------------------------------------------------------------


@dataclass
class ProducerProcess:
    """A producer in a child process; `address` and `entries` from its ready line."""

    process: subprocess.Popen[str]
    address: str
    entries: tuple[ServedEntry, ...]
    errors: IO[str]
    hooks: bool

    @property
    def sizes(self) -> dict[str, int]:
        return {e.mm_hash: e.nbytes for e in self.entries}

    def command(self, line: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Send a hook command; its one-line JSON answer."""
        assert self.hooks, "only peer_producer_process.py takes commands"
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        assert ready, f"producer did not answer {line!r}: {self.stderr()}"
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        return answer

    def stats(self) -> dict[str, Any]:
        return self.command("stats")

    def stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()[-4000:]

    def kill(self) -> None:
        """SIGKILL: die without closing anything, as a crashed producer would."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            if self.hooks:
                assert self.process.stdin is not None
                self.process.stdin.close()  # the hook script stops on EOF
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.errors.close()


def start_producer_process(
    *,
    synthetic: str,
    config: Mapping[str, Any],
    fingerprint: str = FINGERPRINT,
    hooks: bool = False,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    started: list[ProducerProcess] | None = None,
) -> ProducerProcess:
    """Start a producer (`ecshare serve`, or the hook script) and wait for its ready line.

    `config` is layered over FAST and passed as command-line flags.
    """
    program = [str(HOOK_SCRIPT)] if hooks else ["-m", "ecshare", "serve"]
    cmd = [
        *prefix,
        sys.executable,
        *program,
        "--synthetic",
        synthetic,
        "--fingerprint",
        fingerprint,
        *flags({**FAST, **config}),
    ]
    # A file, not a pipe, for stderr: nobody drains it while the producer runs.
    errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
    process = popen_session(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=child_env(env),
    )
    producer = ProducerProcess(process, "", (), errors, hooks)
    if started is not None:
        started.append(producer)  # killed at teardown even if it never gets ready
    assert process.stdout is not None
    deadline = time.monotonic() + 60.0
    while True:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = process.stdout.readline() if ready else ""
        said = parse_ready(line, ProducerReady)
        if said is not None:
            producer.address = said.address
            producer.entries = said.entries
            return producer
        if not line:
            producer.kill()
            raise AssertionError(f"producer did not start ({cmd}): {producer.stderr()}")


SpawnProducer = Callable[..., ProducerProcess]


@contextlib.contextmanager
def producer_processes() -> Iterator[SpawnProducer]:
    """`start_producer_process`, each producer stopped at the end of the with-block."""
    started: list[ProducerProcess] = []

    def spawn(**kwargs: Any) -> ProducerProcess:
        return start_producer_process(started=started, **kwargs)

    try:
        yield spawn
    finally:
        for producer in started:
            producer.stop()


@pytest.fixture
def spawn_producer() -> Iterator[SpawnProducer]:
    with producer_processes() as spawn:
        yield spawn


# -- in-process nodes ----------------------------------------------------------------------------


def config_of(*layers: Mapping[str, Any]) -> Config:
    merged: dict[str, Any] = {}
    for layer in (FAST, *layers):
        merged.update(layer)
    return Config.from_dict(merged)


MakeConsumer = Callable[..., tuple[Node, Consumer]]
MakeProducer = Callable[..., tuple[Node, Producer]]


class Started:
    """Peers started in this process on nodes the caller made; each stopped, and its
    node closed, at `close()`. A node whose peer cannot start is closed at once."""

    def __init__(self) -> None:
        self._made: list[tuple[Node, Producer | Consumer]] = []

    def producer(
        self,
        node: Node,
        entries: Mapping[str, int] | None = None,
        fingerprint: str = FINGERPRINT,
    ) -> tuple[Node, Producer]:
        """`node`'s producer, serving `entries` (their `expected` bytes)."""
        try:
            for h, nbytes in (entries or {}).items():
                node.store.put(h, expected(h, nbytes))
            producer = start_producer(node, fingerprint=fingerprint)
        except BaseException:
            node.close()
            raise
        self._made.append((node, producer))
        return node, producer

    def consumer(self, node: Node, fingerprint: str = FINGERPRINT) -> tuple[Node, Consumer]:
        try:
            consumer = start_consumer(node, fingerprint=fingerprint)
        except BaseException:
            node.close()
            raise
        self._made.append((node, consumer))
        return node, consumer

    def close(self) -> None:
        for node, peer in self._made:
            peer.stop()
            node.close()


@contextlib.contextmanager
def consumers() -> Iterator[MakeConsumer]:
    """Consumers in this process on nodes of their own, stopped at the end of the with-block."""
    started = Started()

    def make(*layers: Mapping[str, Any], fingerprint: str = FINGERPRINT) -> tuple[Node, Consumer]:
        return started.consumer(Node.create(config_of(*layers), "consumer"), fingerprint)

    try:
        yield make
    finally:
        started.close()


@pytest.fixture
def make_consumer() -> Iterator[MakeConsumer]:
    with consumers() as make:
        yield make


@pytest.fixture
def make_producer() -> Iterator[MakeProducer]:
    """A producer in this process, so that a test can watch its pins directly."""
    started = Started()

    def make(
        *layers: Mapping[str, Any],
        entries: Mapping[str, int] | None = None,
        fingerprint: str = FINGERPRINT,
    ) -> tuple[Node, Producer]:
        return started.producer(Node.create(config_of(*layers), "producer"), entries, fingerprint)

    yield make
    started.close()


# -- a raw control-plane client ------------------------------------------------------------------


class RawSession:
    """A hand-driven consumer session: Hello, FetchRequests, heartbeats, nothing automatic."""

    def __init__(self, client: ControlClient, fingerprint: str = FINGERPRINT) -> None:
        self.client = client
        self.fingerprint = fingerprint
        self.session_id = uuid.uuid4().hex
        self._seq = 0

    def call(self, message: p.Message, timeout_s: float = 5.0) -> p.Message:
        """Send, and return the next reply that is not a heartbeat ack."""
        self.client.send(message)
        deadline = time.monotonic() + timeout_s
        while True:
            left = int(max(0.0, deadline - time.monotonic()) * 1000)
            reply = self.client.recv(timeout_ms=left)
            if reply is None:
                raise AssertionError(f"no reply to {type(message).__name__} in {timeout_s} s")
            if not isinstance(reply, p.HeartbeatAck):
                return reply

    def hello(self, versions: Sequence[int] = p.SUPPORTED_VERSIONS) -> p.Message:
        return self.call(
            p.Hello(
                versions=list(versions),
                session_id=self.session_id,
                client_name="raw-test-client",
                fingerprint=self.fingerprint,
            )
        )

    def fetch(self, request_id: str, *hashes: str) -> p.Message:
        items = [p.ItemRequest(h) for h in hashes]
        return self.call(
            p.FetchRequest(session_id=self.session_id, request_id=request_id, items=items)
        )

    def heartbeat(self) -> None:
        self._seq += 1
        self.client.send(p.Heartbeat(session_id=self.session_id))
        while self.client.recv(timeout_ms=0) is not None:
            pass

    def keep_alive_until(
        self, predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1
    ) -> bool:
        """Heartbeat (so the session lives) until `predicate` holds or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            self.heartbeat()
            time.sleep(interval_s)
        return True


MakeRawSession = Callable[..., RawSession]


@contextlib.contextmanager
def raw_sessions(keyring: Keyring) -> Iterator[MakeRawSession]:
    """Raw sessions with the consumer's key, closed at the end of the with-block."""
    clients: list[ControlClient] = []

    def make(address: str, *, fingerprint: str = FINGERPRINT, insecure: bool = False) -> RawSession:
        client = ControlClient(
            address,
            server_public_key=None if insecure else keyring.producer.public,
            keys=None if insecure else keyring.consumer,
            insecure=insecure,
            settings=RAW_LINK,
        )
        clients.append(client)
        return RawSession(client, fingerprint)

    try:
        yield make
    finally:
        for client in clients:
            client.close()


@pytest.fixture
def raw_session(keyring: Keyring) -> Iterator[MakeRawSession]:
    with raw_sessions(keyring) as make:
        yield make


# -- a consumer process --------------------------------------------------------------------------


def fetch_command(
    address: str,
    hashes: Sequence[str],
    config: Mapping[str, Any],
    *,
    fingerprint: str = FINGERPRINT,
    timeout_s: float = 20.0,
    prefix: Sequence[str] = (),
) -> list[str]:
    """`ecshare fetch` that checks synthetic content and prints one JSON object."""
    return [
        *prefix,
        sys.executable,
        "-m",
        "ecshare",
        "fetch",
        address,
        *hashes,
        "--fingerprint",
        fingerprint,
        "--verify-synthetic",
        "--json",
        "--timeout",
        str(timeout_s),
        *flags(config),
    ]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts itself; killed at teardown if still running."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


# -- a producer driven by hand ------------------------------------------------------------------


class FakeProducer:
    """A producer's control server driven by hand, with a real NIXL data plane to announce."""

    def __init__(self, keyring: Keyring) -> None:
        self.server = ControlServer(
            keys=keyring.producer,
            authorized=frozenset({keyring.consumer.public}),
            settings=LinkSettings(heartbeat_ivl_s=0.2, heartbeat_timeout_s=1.0),
        )
        self.mm = mmap.mmap(-1, 1 << 20)
        # Progressing on its own, as a producer's data plane does by default: the
        # consumer's warm-up read at the Welcome needs it to.
        self.transport = NixlTransport(
            f"fake-producer-{uuid.uuid4().hex[:8]}", progress_thread=True
        )
        addr = int(np.frombuffer(self.mm, dtype=np.uint8).ctypes.data)
        self.transport.register(addr, 1 << 20)
        self.address = f"tcp://127.0.0.1:{self.server.port}"
        self.route = b""
        self.session_id = ""
        # Fields of the Welcome's data plane to tell otherwise (a lying producer).
        self.announce: dict[str, Any] = {}

    def recv(self, kind: type[Any], timeout_s: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            inbound = self.server.recv(timeout_ms=100)
            if inbound is None:
                continue
            self.route = inbound.peer
            if isinstance(inbound.message, p.Heartbeat):
                self.server.send(inbound.peer, p.HeartbeatAck())
                continue
            if isinstance(inbound.message, kind):
                return inbound.message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def welcome(
        self, hello: p.Hello, capabilities: list[str], version: int = p.PROTOCOL_VERSION
    ) -> None:
        info = self.transport.local_info()
        self.session_id = hello.session_id
        self.server.send(
            self.route,
            p.Welcome(
                version=version,
                session_id=hello.session_id,
                server_name="fake",
                capabilities=capabilities,
                lease_ms=3000,
                heartbeat_ms=200,
                max_batch_items=16,
                data_plane=msgspec.structs.replace(announced(info), **self.announce),
            ),
        )

    def offer(self, push_id: str, mm_hash: str = "h", nbytes: int = 100_000) -> p.PushReply:
        self.server.send(
            self.route,
            p.PushOffer(
                session_id=self.session_id,
                push_id=push_id,
                mm_hash=mm_hash,
                nbytes=nbytes,
                dtype="uint8",
                shape=[nbytes],
            ),
        )
        reply: p.PushReply = self.recv(p.PushReply)
        return reply

    def close(self) -> None:
        self.server.close()
        self.transport.close()
        self.mm.close()


@pytest.fixture
def fake_producer(keyring: Keyring) -> Iterator[FakeProducer]:
    fake = FakeProducer(keyring)
    yield fake
    fake.close()
