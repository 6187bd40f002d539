"""Helpers and fixtures for the control-plane tests: keys on disk, peers in and out of process.

The fixtures are registered by this directory's conftest.py; test modules import the
helpers from here (a uniquely named module, unlike conftest).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from ecshare.control import (
    ControlClient,
    ControlServer,
    KeyFiles,
    KeyPair,
    LinkSettings,
    generate_keypair,
    load_keypair,
)

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).with_name("control_peer_process.py")
FAST = LinkSettings(heartbeat_ivl_s=0.2, heartbeat_timeout_s=1.0, handshake_timeout_s=2.0)


@dataclass(frozen=True)
class Identity:
    files: KeyFiles
    keys: KeyPair


@dataclass(frozen=True)
class Keyring:
    server: Identity
    client: Identity  # on the server's allow-list
    stranger: Identity  # a valid key pair nobody authorized
    authorized_file: Path


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    def identity(name: str) -> Identity:
        files = generate_keypair(tmp_path / "keys", name)
        return Identity(files=files, keys=load_keypair(files.secret_path))

    server, client, stranger = identity("server"), identity("client"), identity("stranger")
    authorized = tmp_path / "authorized_keys"
    authorized.write_text(f"# consumers allowed to read\n{client.keys.public_text}  client\n")
    return Keyring(server=server, client=client, stranger=stranger, authorized_file=authorized)


@pytest.fixture
def make_server() -> Iterator[Callable[..., ControlServer]]:
    servers: list[ControlServer] = []

    def make(**kwargs: Any) -> ControlServer:
        server = ControlServer(**{"settings": FAST, **kwargs})
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def make_client() -> Iterator[Callable[..., ControlClient]]:
    clients: list[ControlClient] = []

    def make(endpoint: str, **kwargs: Any) -> ControlClient:
        client = ControlClient(endpoint, **{"settings": FAST, **kwargs})
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start_peer(*args: str) -> subprocess.Popen[str]:
    """Start the peer script (call or raw mode) without waiting for it."""
    return subprocess.Popen(
        [sys.executable, str(PEER_SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def finish_peer(process: subprocess.Popen[str], timeout_s: float = 20.0) -> dict[str, Any]:
    """Wait for a started peer and return the JSON line it printed."""
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    lines = out.strip().splitlines()
    assert process.returncode == 0 and lines, f"peer failed ({process.returncode}): {err}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run_peer(*args: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """Run the peer script to completion and return the JSON line it printed."""
    return finish_peer(start_peer(*args), timeout_s)


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    endpoint: str
    port: int
    errors: IO[str]

    def kill(self) -> None:
        """Die without closing anything, as a crashed producer would."""
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the serve loop exits on EOF
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.errors.close()


@pytest.fixture
def spawn_server() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def spawn(*args: str) -> ServerProcess:
        # A file, not a pipe, for stderr: nobody drains it while the server runs.
        errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        process = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), "serve", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=_env(),
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 20.0)
        line = process.stdout.readline() if ready else ""
        if not line:
            process.kill()
            process.wait(timeout=10)
            errors.seek(0)
            detail = errors.read()
            errors.close()
            raise AssertionError(f"server process did not start: {detail}")
        info = json.loads(line)
        server = ServerProcess(
            process=process, endpoint=info["endpoint"], port=info["port"], errors=errors
        )
        started.append(server)
        return server

    yield spawn
    for server in started:
        server.stop()
